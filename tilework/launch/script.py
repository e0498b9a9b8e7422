"""What each worker of `tilework run` executes: the user's script, as `python SCRIPT ARGS` would run
it, with a failure reported as `tilework train`'s workers report theirs (faults.stop_worker).

    python -u -m tilework.launch.script SCRIPT [ARGS...]

So that a failing script is told in one line, not a traceback from every rank: the rank at
fault prints one traceback (a bug) or none (a UserError, a lost peer), and the launcher's summary
reads "rank 1 failed (exit code 1): ValueError: boom".
"""

from __future__ import annotations

import os
import runpy
import sys
from types import TracebackType


def main() -> None:
    from ..cluster.worker_env import WorkerEnv

    script, args = sys.argv[1], sys.argv[2:]
    env = WorkerEnv.from_environ()  # this worker's entry point: read once, before the script runs
    _as_python_runs(script, args)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if _group_open():
            _leave_group(_exit_code(e))
        raise  # unchanged, as python would have exited
    except Exception as e:  # noqa: BLE001 - the user's failure, reported in one line
        from .faults import stop_worker

        stop_worker(e.with_traceback(_from_script(e.__traceback__, script)), env)
    if _group_open():
        _leave_group(0)


def _as_python_runs(script: str, args: list[str]) -> None:
    """Set sys.argv and sys.path[0] as `python SCRIPT ARGS` does.

    run_path sets sys.argv[0] and __file__ to the path it is given: the path as typed, so that
    sys.argv is exactly python's (python makes __file__ absolute, since 3.9; here it stays as
    typed, as before that).
    """
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # python follows a symlinked script


def _from_script(tb: TracebackType | None, path: str) -> TracebackType | None:
    """The traceback from the script's first frame on, as python prints it: the frames before
    it are this runner's and runpy's (a syntax error in the script has none of the script's)."""
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    return tb


def _group_open() -> bool:
    dist = sys.modules.get("torch.distributed")  # a script that never imported it has no group
    return dist is not None and dist.is_available() and dist.is_initialized()


def _exit_code(e: SystemExit) -> int:
    """The status python exits with for `e`; like python, print a code that is not a number."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _leave_group(code: int) -> None:
    """Exit as tilework's own workers do with a process group open (comm.exit_worker: the
    interpreter's teardown can abort there, which the launcher reads as a failed rank), after
    the exit handlers the script registered, which that skips."""
    import atexit

    from ..comm import exit_worker

    atexit._run_exitfuncs()
    exit_worker(code)  # does not return


if __name__ == "__main__":
    main()
