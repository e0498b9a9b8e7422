"""What a failed run tells its user: the rank that caused it, in one line, not a wall of tracebacks.

Worker side (`worker_failure`, `stop_worker`): a worker that fails (`tilework train`'s, or a
script under `tilework run`) says so in one line on stderr and in torchelastic's error file, and
its exit code says what kind of failure it was:

- `USER_ERROR_EXIT` (2): bad input, a non-finite loss, mismatched batches: the cause itself;
- `LOST_PEER_EXIT` (75, EX_TEMPFAIL): a collective failed because a peer vanished or did not
  answer within the timeout: a consequence of a failure elsewhere (or of the network);
- `PEER_FAULT_EXIT` (76): every rank agreed that another rank fed bad input
  (parallel/data/checks.py), and this one stopped with it;
- anything else (1): a bug, in tilework or in the user's script, which keeps its traceback.

Launcher side (`summarize`): from each failed rank's exit code and message, the causes first
(killed by a signal, failed on its own), then the ranks that stopped because of them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from ..cluster.worker_env import record_for_launcher

if TYPE_CHECKING:
    from ..cluster.worker_env import WorkerEnv

USER_ERROR_EXIT = 2
LOST_PEER_EXIT = 75
PEER_FAULT_EXIT = 76

# What gloo, NCCL and the TCPStore say when the other side of a collective is gone or silent.
# gloo's "Application timeout caused pair closure" is what a second collective in flight gets
# once the first one's timeout has closed the connection (seen with a host's link cut).
_LOST_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "Connection refused", "No route to host", "Timed out", "timed out",
                    "Timeout", "NCCL communicator was aborted", "Socket Timeout",
                    "failed to recv", "failed to send", "Application timeout caused pair closure")


def lost_peer_reason(exc: BaseException) -> str | None:
    """The first line of a collective's error when it means a peer is gone, else None."""
    import torch.distributed as dist

    text = str(exc)
    if isinstance(exc, getattr(dist, "DistNetworkError", ())) or \
            any(sign in text for sign in _LOST_PEER_SIGNS):
        line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        # gloo prefixes its source location: "[.../pair.cc:553] Connection closed by peer ..."
        if line.startswith("[") and "] " in line:
            line = line.split("] ", 1)[1]
        return line.split(". This is typically")[0]
    return None


@dataclass(frozen=True)
class WorkerFailure:
    exit_code: int
    line: str          # what the user reads; also the launcher's message for this rank
    traceback: bool    # a bug: print the traceback too


def worker_failure(exc: BaseException, rank: int, timeout_s: float | None = None) -> WorkerFailure:
    from ..errors import InputError, UserError

    if isinstance(exc, InputError) and rank not in exc.ranks:
        return WorkerFailure(PEER_FAULT_EXIT, f"rank {rank}: stopped with the rank at fault: {exc}",
                             traceback=False)
    if isinstance(exc, UserError):
        return WorkerFailure(exc.exit_code, f"rank {rank}: {exc}", traceback=False)
    reason = lost_peer_reason(exc)
    if reason is not None:
        within = f" (collective timeout {timeout_s:g} s)" if timeout_s else ""
        return WorkerFailure(LOST_PEER_EXIT, f"rank {rank}: lost contact with its peers{within}: "
                                             f"{reason}", traceback=False)
    return WorkerFailure(1, f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0],
                         traceback=True)


def stop_worker(exc: BaseException, env: WorkerEnv) -> NoReturn:
    """End this rank of a launched group on `exc`: its line on stderr and for the launcher, the
    traceback only for a bug, and the exit code that says whether this rank caused the failure.
    `env`: this rank, its collective timeout and where the launcher reads its failure.

    The one place a worker's exception becomes its report (`tilework train`'s workers and the
    scripts under `tilework run` alike).
    """
    import traceback

    yield_to_the_guards_verdict()
    failure = worker_failure(exc, env.rank, env.collective_timeout_s)
    if failure.traceback:
        traceback.print_exception(exc)
    sys.stderr.write(f"tilework: error: {failure.line}\n")  # one write: ranks share stderr
    sys.stderr.flush()
    record_for_launcher(failure.line, env.error_file)
    sys.stdout.flush()
    # No teardown: a process group whose peer vanished can block in its destructors.
    os._exit(failure.exit_code)


def yield_to_the_guards_verdict() -> None:
    """Where the call guard found why the ranks diverged, let it end this process with that
    reason: the exception at hand (a peer that left first) is only its consequence. Returns at
    once when the guard has no verdict."""
    from ..comm import guard

    if guard.STOPPING.is_set():
        time.sleep(2 * guard.ANSWER_S)   # the guard's thread exits the process within ANSWER_S


# -- launcher side -----------------------------------------------------------------------------

def _signal_name(exit_code: int) -> str:
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def summarize(failures: dict[int, tuple[int, str]]) -> list[str]:
    """Lines for the user from {rank: (exit code, message)}: causes, then consequences.

    The agent stops every other worker with SIGTERM once one fails, so a SIGTERM is a
    consequence; so is `LOST_PEER_EXIT`. Everything else is a cause.
    """
    causes: dict[str, list[int]] = {}  # what happened -> the ranks it happened to
    lost, stopped = [], []
    for rank, (code, message) in sorted(failures.items()):
        if code in (-signal.SIGTERM, PEER_FAULT_EXIT):
            stopped.append(rank)
        elif code == LOST_PEER_EXIT:
            lost.append((rank, message))
        elif code < 0:
            causes.setdefault(f"killed by {_signal_name(code)}", []).append(rank)
        else:
            last = message.strip().splitlines()[-1] if message and message.strip() else ""
            if last.startswith(f"rank {rank}: "):
                last = last[len(f"rank {rank}: "):]
            generic = last.startswith("To enable traceback")
            what = f"failed (exit code {code})" + (f": {last}" if last and not generic else "")
            causes.setdefault(what, []).append(rank)
    lines = [f"{_ranks(ranks)} {'was' if len(ranks) == 1 else 'were'} {what}"
             if what.startswith("killed") else f"{_ranks(ranks)} {what}"
             for what, ranks in causes.items()]
    if lost:
        reason = lost[0][1].split(": ", 2)[-1] if lost[0][1] else ""
        lines.append(f"{_ranks([r for r, _ in lost])} lost contact with "
                     f"{'its' if len(lost) == 1 else 'their'} peers"
                     + (f" ({reason})" if reason else ""))
        if not causes:
            lines.append("no rank failed on its own: a host or its network link went away, "
                         "or a rank stopped answering (a hang, or a timeout set too short)")
    if stopped:
        lines.append(f"{_ranks(stopped)} stopped with {'them' if len(causes) > 1 else 'it'}")
    return lines


class LauncherLog(logging.Handler):
    """Turns the elastic agent's log into tilework's lines: a failed worker and a restart, in
    one line each; the rest of its chatter is dropped (`verbose` keeps it)."""

    AGENT = "torch.distributed.elastic"

    def __init__(self, stream=None, verbose: bool = False):
        super().__init__(logging.INFO)
        self.stream = stream or sys.stderr
        self.verbose = verbose

    def emit(self, record: logging.LogRecord) -> None:
        # The agent's own "failed (exitcode ...)" line names whichever failure has the smallest
        # whole-second timestamp, often a rank that merely lost its peer: dropped. The workers
        # say why they stopped; `summarize` names the cause at the end.
        msg, args = record.msg, record.args or ()
        line = None
        if isinstance(msg, str) and "will restart worker group" in msg and len(args) == 4:
            _, _, left, most = args
            line = f"a worker failed; restarting them all (restart {int(most) - int(left) + 1} " \
                   f"of {most})"
        elif self.verbose or record.levelno >= logging.CRITICAL:
            line = self.format(record)
        if line:
            self.stream.write(f"tilework run: {line}\n")
            self.stream.flush()

    def install(self) -> None:
        parent = logging.getLogger(self.AGENT)
        parent.addHandler(self)
        parent.propagate = False
        # The agent logs its restarts at INFO; its loggers are created at WARNING.
        logging.getLogger(f"{self.AGENT}.agent.server.api").setLevel(logging.INFO)

    def uninstall(self) -> None:
        parent = logging.getLogger(self.AGENT)
        parent.removeHandler(self)
        parent.propagate = True
