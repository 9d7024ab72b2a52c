"""Errors raised while framing, shaping and receiving KV transfers.

Every error carries the request id it concerns when one is known, so a receiver can fail exactly
that request and keep serving the others.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class: a KV transfer (or one frame of it) could not be completed."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class FrameError(TransferError):
    """A frame could not be read from the stream; the connection cannot be trusted any more."""


class BadMagicError(FrameError):
    """The stream does not start with the frame magic (wrong protocol or lost sync)."""


class UnsupportedVersionError(FrameError):
    """The frame was written by an incompatible version of the format."""


class MalformedFrameError(FrameError):
    """The header decodes but its fields are invalid (unknown kind, inverted range, bad id)."""


class TruncatedFrameError(FrameError):
    """The stream ended in the middle of a frame."""


class StreamClosedError(FrameError):
    """The stream ended cleanly between two frames (nothing truncated, nothing more sent)."""


class ChecksumError(FrameError):
    """A CRC32 did not match: the payload (or, for the header checksum, the header) is corrupt."""


class OversizeFrameError(FrameError):
    """The header announces a payload larger than the receiver accepts."""


class PartialTransferError(TransferError):
    """A transfer ended without a valid END frame, or END disagrees with what arrived."""


class TransferProtocolError(TransferError):
    """Frames arrived in an order the protocol forbids (e.g. two requests interleaved)."""


class RemoteAbortError(TransferError):
    """The sender aborted the transfer with an ERROR frame; the message is the sender's reason."""
