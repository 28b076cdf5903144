"""The Hugging Face policies moved to ``benchmarks/hf_zoo.py`` (Llama and the other families); re-exported here."""

from benchmarks.hf_zoo import *  # noqa: F401,F403
from benchmarks.hf_zoo import __all__  # noqa: F401
