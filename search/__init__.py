"""autoshard subpackage."""
