"""Collectives guarded: a tilework call made by some ranks but not by the others stops every rank
within seconds, saying which call it was, instead of hanging until the collective timeout.

Every collective call of the engine (a table lookup in the forward, the gradient sync at the end
of backward, optimizer.step(), model.state_dict(), clipping) runs inside `CallGuard.call(name)`,
which numbers it. In a correct program the numbers and names agree on every rank. The normal path
costs two attribute writes per call; nothing is sent.

A watcher thread per rank looks every POLL_S seconds. When this rank has waited STUCK_S seconds in
one call, it asks every rank, through the process group's store (a side channel that works while
the collectives are stuck), where it is: in which call, or blocked in a collective that is not
tilework's (a `dist.barrier()` in the script, say), or computing. Mismatched calls, or a rank
blocked elsewhere before making this call, are a verdict: it is written to the store, and every
rank prints it in one line and exits with code 2. A rank that is merely slow (computing,
compiling) is no verdict: the asker waits and asks again later.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import sys
import threading
import time
import weakref

STUCK_S = 2.0
POLL_S = 0.5
ANSWER_S = 3.0
EXIT_CODE = 2
STOPPING = threading.Event()  # set once this process is being ended with a verdict
# Guards are numbered in the order they are made, the same on every rank (each rank runs the same
# program), so that each engine's questions and answers have keys of their own.
_numbers = itertools.count()
# The watcher threads, ended at interpreter exit before finalization (_end_watchers).
_EXITING = threading.Event()
_watchers: list[threading.Thread] = []


def _end_watchers() -> None:
    """Each watcher thread ended and joined before the interpreter finalizes. A daemon thread
    still inside a store call then (the store releases the GIL) is ended by CPython with
    pthread_exit when it takes the GIL back, and that forced unwind through pybind11's frames
    aborts the process: "terminate called without an active exception", SIGABRT at exit
    (found by bench/soak.py: 8 of 43 emulated-host runs, where store calls cross shaped
    links and take long; gdb showed the thread in Store.check under Py_FinalizeEx)."""
    _EXITING.set()
    for thread in _watchers:
        thread.join(timeout=ANSWER_S)


atexit.register(_end_watchers)


class CallGuard:
    def __init__(self, store, rank: int, world_size: int, error_file: str | None = None,
                 stuck_s: float = STUCK_S):
        self.store, self.rank, self.world_size, self.stuck_s = store, rank, world_size, stuck_s
        self.error_file = error_file  # where the launcher reads why this rank stopped
        self.seq = 0
        self.current: tuple[int, str, float] | None = None  # (number, name, since) while inside
        self.last = "parallelize"
        self.main = threading.get_ident()
        self.stopped = threading.Event()
        if store is not None and world_size > 1:
            self.prefix = f"tilework/guard/{next(_numbers)}/"
            # The thread holds the guard weakly: it ends when the engine (and its model) is gone.
            watcher = threading.Thread(target=_watch, args=(weakref.ref(self),),
                                       name="tilework-guard", daemon=True)
            _watchers[:] = [t for t in _watchers if t.is_alive()] + [watcher]
            watcher.start()

    @contextlib.contextmanager
    def call(self, name: str):
        if self.current is not None:  # nested in another guarded call: that one counts
            yield
            return
        self.seq += 1
        self.current = (self.seq, name, time.monotonic())
        try:
            yield
        finally:
            self.current, self.last = None, name

    def stop(self) -> None:
        self.stopped.set()

    # -- the watcher thread (see _watch) --------------------------------------------------------
    def _look(self, state: dict) -> None:
        """One look: the verdict, questions to answer, and whether to ask one."""
        store, prefix = self.store, self.prefix
        if store.check([prefix + "verdict"]):
            self._stop_here(store.get(prefix + "verdict").decode())
        asked = store.add(prefix + "asked", 0)
        for number in range(state["answered"] + 1, asked + 1):
            self._answer(number)
        state["answered"] = asked
        current, now = self.current, time.monotonic()
        if state["question"] is not None:
            state["question"] = self._judge(*state["question"])
        elif current is not None and now - current[2] > self.stuck_s and now >= state["next_ask"]:
            state["next_ask"] = now + self.stuck_s
            state["question"] = (store.add(prefix + "asked", 1), current, now + ANSWER_S)

    def _judge(self, number: int, current, give_up: float):
        """The question still open, or None once judged (a verdict ends the process)."""
        keys = [f"{self.prefix}{number}/{r}" for r in range(self.world_size)]
        if not self.store.check(keys):
            # A rank that does not answer is no evidence either way.
            return (number, current, give_up) if time.monotonic() < give_up else None
        if self.current != current:  # the call completed meanwhile
            return None
        verdict = mismatch([json.loads(self.store.get(k)) for k in keys], self.rank)
        if verdict:
            self.store.set(self.prefix + "verdict", verdict)
            self._stop_here(verdict)
        return None

    def _position(self) -> dict:
        current = self.current
        where = {"rank": self.rank, "seq": self.seq, "last": self.last, "inside": None,
                 "foreign": None}
        if current is not None:
            where["inside"] = current[1]
        else:
            where["foreign"] = foreign_collective(sys._current_frames().get(self.main))
        return where

    def _answer(self, question: int) -> None:
        self.store.set(f"{self.prefix}{question}/{self.rank}", json.dumps(self._position()))

    def _stop_here(self, verdict: str) -> None:
        from ..cluster.worker_env import record_for_launcher

        STOPPING.set()
        line = f"rank {self.rank}: {verdict}"
        sys.stderr.write(f"tilework: error: {line}\n")
        sys.stderr.flush()
        record_for_launcher(line, self.error_file)
        sys.stdout.flush()
        # Leave once every rank has read the verdict (or after ANSWER_S): a rank leaving first
        # would show the others only a lost peer.
        seen, deadline = self.store.add(self.prefix + "seen", 1), time.monotonic() + ANSWER_S
        while seen < self.world_size and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
            seen = self.store.add(self.prefix + "seen", 0)
        # The main thread is blocked in a collective that will never complete: nothing else can
        # end this process.
        os._exit(EXIT_CODE)


def _watch(ref) -> None:
    """The watcher thread: a look every POLL_S seconds (more often while a question is open)."""
    state = {"answered": 0, "next_ask": 0.0, "question": None}
    while not _EXITING.is_set():
        guard = ref()
        if guard is None or guard.stopped.is_set():
            return
        try:
            guard._look(state)
        except Exception:  # noqa: BLE001 - the store went away: the run is ending anyway
            return
        del guard
        _EXITING.wait(POLL_S if state["question"] is None else POLL_S / 5)


FIX = ("every rank must call the model, backward(), optimizer.step() and model.state_dict() "
       "together, in the same order (to evaluate on one rank, load "
       "tilework.state_dict(model, opt)['model'] into a plain copy of the model)")


def mismatch(positions: list[dict], asker: int) -> str | None:
    """The verdict from every rank's position, or None where the asker may just be early."""
    me = positions[asker]
    for other in positions:
        if other["rank"] == asker:
            continue
        if other["inside"] is not None and other["seq"] == me["seq"] \
                and other["inside"] != me["inside"]:
            return (f"ranks disagree on tilework's call {me['seq']}: rank {asker} is in "
                    f"{me['inside']}, rank {other['rank']} in {other['inside']}; {FIX}")
        if other["inside"] is None and other["foreign"] and other["seq"] < me["seq"]:
            return (f"rank {asker} is in {me['inside']} (call {me['seq']}), which rank "
                    f"{other['rank']} has not made: it waits in {other['foreign']} (its last "
                    f"tilework call was {other['last']}); {FIX}")
    return None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where tilework's collectives run inside the model's own forward and backward (tensor-,
# context- and pipeline-parallel layers), outside any guarded call.
_COUNTED = os.path.join(_PACKAGE, "comm", "counted.py")
_IN_MODEL = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("tensor", "context", "pipeline"))


def _inside_tilework(path: str) -> bool:
    return os.path.abspath(path).startswith(_IN_MODEL)


def foreign_collective(frame) -> str | None:
    """'torch.distributed.barrier called at train.py:12' when the thread whose innermost frame is
    `frame` is blocked in a torch.distributed collective, else None."""
    function, caller = None, None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if path.endswith("torch/distributed/distributed_c10d.py") and \
                not frame.f_code.co_name.startswith("_"):
            function, caller = frame.f_code.co_name, frame.f_back
        frame = frame.f_back
    if function is None:
        return None
    while caller is not None and "/torch/" in caller.f_code.co_filename.replace("\\", "/"):
        caller = caller.f_back
    inner = caller   # past the counting wrappers, to who asked for the collective
    while inner is not None and os.path.abspath(inner.f_code.co_filename) == _COUNTED:
        inner = inner.f_back
    if inner is not None and _inside_tilework(inner.f_code.co_filename):
        # A model-parallel layer's collective (tp, cp, pp), in the model's forward or
        # backward: the rank is computing its step, not waiting in the script's collective.
        return None
    where = f" called at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}" \
        if caller is not None else ""
    return f"torch.distributed.{function}{where}"
