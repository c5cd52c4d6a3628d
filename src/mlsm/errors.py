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


class Stopped(Exception):
    """A command a signal stopped early after saving what it needs to go on (pre-training's
    checkpoint; the line saying how to resume is already printed): the CLI exits with `status`
    (`mlsm.train.signals.exit_status`: 130 for SIGINT, 143 for SIGTERM, or 0 if asked)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"stopped by a signal (exit status {status})")
        self.status = status
