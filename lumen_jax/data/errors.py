"""The one exception of the data package."""


class DataError(ValueError):
    """A user-fixable problem with the data: a missing or corrupt file, a bad glob, a bad tokenizer.

    The message is one line naming the file (and line or row) and the fix.
    """
