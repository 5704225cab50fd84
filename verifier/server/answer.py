"""An answer a caller waits for: the one handle the scheduler, the sessions and the service share."""


class Answer:
    """What a caller waits for without an asyncio future of its own: `result` once answered (None
    before); `on_done(callback)` calls back then (at once if it is); `finish(result)` answers and
    calls back synchronously. (A future per step, gathered per call, cost a callback handle per
    step on the event loop.)"""

    __slots__ = ("result", "_callbacks")

    def __init__(self, result=None):
        self.result = result
        self._callbacks: list = []

    def on_done(self, callback) -> None:
        """callback() once answered (at once if it is)."""
        if self.result is not None:
            callback()
        else:
            self._callbacks.append(callback)

    def finish(self, result) -> None:
        self.result = result
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
