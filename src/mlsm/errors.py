"""The one exception type users see: a one-line message that names the fix."""


class UserError(Exception):
    """Bad input or configuration. The message is one line and says how to fix it."""
