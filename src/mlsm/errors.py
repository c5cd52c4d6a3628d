"""The one exception type users see: a one-line message that names the fix."""


class UserError(Exception):
    """Bad input or configuration. The message is one line and says how to fix it."""


class Incomplete(Exception):
    """A command did all it could, but part of it failed (a stage of a study, an arm): the CLI
    prints the one-line message (which stages, where their errors are) and exits with status 1,
    so a script or scheduler sees the failure. `report`: what was written despite it, if any."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report
