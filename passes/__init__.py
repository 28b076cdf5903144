"""autoshard subpackage."""

from autoshard.passes.capture import capture

__all__ = ["capture"]
