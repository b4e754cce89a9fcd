"""Exception hierarchy. Every error names the thing that is wrong."""


class TierstoreError(Exception):
    """Base class of every error tierstore raises on purpose."""


class FormatError(TierstoreError, ValueError):
    """A tensor's values or shape do not fit the format it claims (NaN, bad shape, bad scales)."""


class CheckpointError(TierstoreError):
    """A checkpoint is unsupported, inconsistent or missing a tensor."""


class PackFormatError(TierstoreError):
    """A pack file or its sidecar is malformed, stale or corrupt."""


class ReadError(TierstoreError, OSError):
    """An I/O read failed or returned fewer bytes than asked for."""


class CapacityError(TierstoreError):
    """A pool, arena or budget is too small for what was asked of it."""


class TraceFormatError(TierstoreError, ValueError):
    """A routing trace file does not follow its documented format."""


class ConfigError(TierstoreError, ValueError):
    """A knob, size or option has a value tierstore cannot use."""
