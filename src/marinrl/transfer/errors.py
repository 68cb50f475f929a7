"""What weight transfer raises (transfer/base.py): one base class, so a caller can catch any of them."""

from __future__ import annotations


class WeightTransferError(RuntimeError):
    """Base of the errors of this package."""


class WeightPublishError(WeightTransferError):
    """A publish that did not complete; the message names the location. The trainer decides."""


class WeightFormatError(WeightTransferError):
    """A published version that is corrupt or does not fit the client's model skeleton."""


class WeightWaitTimeout(WeightTransferError, TimeoutError):
    """`wait_for` saw no version at or above the step it waited for within its timeout."""
