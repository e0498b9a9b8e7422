"""Bad input, fuzzed: random and mutated cluster files, job files and CLI arguments.

Whatever a user writes or types, tilework answers with one clean line (a `ConfigError` or
`UserError`; exit code 2 from the CLI): never a traceback, never a hang. Each example has a
deadline, so a validation that allocates or loops on an absurd value fails here.

The CLI tests replace the steps that would start work (`launch.run`, `trainer.train`,
`bench.suite.run_suite`, `calibrate.measure`) by a function that raises `_WouldRun`: the property
is about validation, which all happens before those steps, and real launches and training are
covered by test_launch.py and test_trainer.py. `plan` is not replaced: it only reads the files
and models the job on the meta device, so it must stay fast and clean on any valid input too.
"""

import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import tilework.bench.suite
import tilework.cluster.calibrate
import tilework.launch.launcher
import tilework.train.trainer
from tilework.cli import main
from tilework.cluster.topology import Cluster, Host
from tilework.config.parallel import ParallelConfig
from tilework.errors import ConfigError, PlanError
from tilework.report.job import report
from tilework.train.job import Job, LMJob

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"
CLUSTER_EXAMPLES = [EXAMPLES / "demo-2hosts.toml", EXAMPLES / "parallax-testbed.toml"]
JOB_EXAMPLES = [EXAMPLES / "demo-job.toml", EXAMPLES / "lm1b.toml", ROOT / "tilework" / "demo.toml"]

# Same examples on every run (a CI failure reproduces), no example database left behind; the
# deadline turns a hang into a failure; no "explain" phase, which takes minutes over a failure.
FUZZ = settings(derandomize=True, database=None, deadline=2000, max_examples=300,
                phases=[Phase.generate, Phase.shrink], suppress_health_check=[HealthCheck.too_slow])


# -- values, and TOML text for them -------------------------------------------------------------

BIG_INTS = [2**31, 2**53 + 1, 2**62, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**30,
            -10**30, 10**400]
INTS = st.one_of(st.integers(-3, 64), st.sampled_from(BIG_INTS), st.integers())
FLOATS = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e300, 1.7e308]))
TEXT = st.text(max_size=12)
SCALARS = st.one_of(INTS, FLOATS, TEXT, st.booleans())
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)


def toml_string(s: str) -> str:
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif " " <= c <= "~":
            out.append(c)
        else:  # TOML forbids raw control characters; escaping everything else is always valid
            out.append(f"\\u{ord(c):04X}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08X}")
    return '"' + "".join(out) + '"'


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # nan, inf and -inf are TOML's spellings too
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_document(doc: dict) -> bytes:
    return "".join(f"{toml_string(k)} = {toml_value(v)}\n" for k, v in doc.items()).encode()


def fields(required: dict | None = None, **optional) -> st.SearchStrategy:
    return st.fixed_dictionaries(required or {}, optional=optional)


# Plausible documents: mostly valid, with extreme values that are still valid (huge sizes, tiny
# rates), so that the planner's side of `plan` is fuzzed too.
COUNT = st.one_of(st.integers(1, 64), st.integers(1, 64),
                  st.sampled_from([2**31, 10**9, 2**62, 2**63 - 1]))
RATE = st.one_of(st.floats(1e-3, 1e3), st.sampled_from([5e-324, 1e-300, 1e300, 1.7e308]))
LINK = fields(bandwidth_gbps=RATE, latency_us=st.one_of(st.just(0.0), RATE))
HOST = fields({"name": st.sampled_from(["node0", "node1", "node2", "h0"])},
              address=st.sampled_from(["127.0.0.1", "node0", ""]), procs=COUNT)
PLAUSIBLE_CLUSTER = fields(
    {"hosts": st.lists(HOST, min_size=1, max_size=4, unique_by=lambda h: h["name"])},
    rendezvous=st.sampled_from(["node0:29500", "node1:1", "127.0.0.1:65535"]),
    links=fields(intra=LINK, inter=LINK))
ALPHA = st.one_of(st.floats(0.1, 3.0), st.sampled_from([1.0, 1.0 + 2**-52, 5e-324, 1e300]))
PLAUSIBLE_JOB = fields(
    workload=st.sampled_from(["lm", "cnn", "recommender"]),
    lm=fields(corpus=st.sampled_from(["stdlib", "zipf"]), vocab=COUNT, embed_dim=COUNT,
              hidden=COUNT, layers=COUNT, seq_len=COUNT, num_sampled=COUNT, sparse=st.booleans(),
              zipf_tokens=COUNT, zipf_alpha=ALPHA, holdout=st.floats(1e-3, 0.49),
              eval_sequences=COUNT),
    cnn=fields(samples=COUNT, num_classes=COUNT, image_size=COUNT, width=COUNT, blocks=COUNT),
    recommender=fields(samples=COUNT, table_sizes=st.lists(COUNT, min_size=1, max_size=4),
                       dense_features=COUNT, embed_dim=COUNT, zipf_alpha=ALPHA,
                       sparse=st.booleans()),
    data=fields(batch_size=COUNT, scaling=st.sampled_from(["strong", "weak"]),
                seed=st.integers(0, 2**63 - 1), shuffle=st.booleans()),
    train=fields(steps=COUNT, optimizer=st.sampled_from(["sgd", "adagrad", "adam"]), lr=RATE,
                 seed=st.integers(0, 2**63 - 1), log_every=COUNT, eval_every=COUNT,
                 checkpoint_every=COUNT, keep_checkpoints=COUNT, out_dir=TEXT),
    parallel=fields(mode=st.sampled_from(["hybrid", "allreduce", "ps"]),
                    sparse_reduce=st.sampled_from(["mean", "sum"]),
                    local_aggregation=st.booleans(), bucket_mb=RATE),
    cache_dir=TEXT)


def _tables(node) -> list[dict]:
    if isinstance(node, list):
        return [t for x in node for t in _tables(x)]
    if isinstance(node, dict):
        return [node] + [t for x in node.values() for t in _tables(x)]
    return []


@st.composite
def documents(draw, plausible: st.SearchStrategy) -> dict:
    """A plausible document with up to three keys set to anything (or added, or dropped)."""
    doc = draw(plausible)
    for _ in range(draw(st.integers(0, 3))):
        node = draw(st.sampled_from(_tables(doc)))
        key = draw(st.one_of(st.sampled_from(sorted(node)), TEXT) if node else TEXT)
        if draw(st.integers(0, 4)) == 0:
            node.pop(key, None)
        else:
            node[key] = draw(VALUES)
    return doc


CLUSTER_DOCS = documents(PLAUSIBLE_CLUSTER)
JOB_DOCS = documents(PLAUSIBLE_JOB)


# -- text mutations of the example files --------------------------------------------------------

LITERALS = ["inf", "-inf", "nan", "+nan", "1e400", "-1", "0", "0.0", "2", "9" * 30, "9" * 5000,
            "-9223372036854775809", "9223372036854775807", '""', '"x"', "[]", "{}", "true",
            "[1, [2]]", "{a = 1}", "1979-05-27", "0x7f", '"\\n"', "[" * 10_000 + "]" * 10_000]
NUMBER = re.compile(rb"-?\d[\d_.e+-]*|\"[^\"\n]*\"|true|false")


@st.composite
def mutated(draw, sources: list[Path]) -> bytes:
    data = draw(st.sampled_from(sources)).read_bytes()
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["value", "value", "delete", "insert", "line", "byte"]))
        if op == "value" and (spans := [m.span() for m in NUMBER.finditer(data)]):
            start, end = draw(st.sampled_from(spans))
            new = draw(st.one_of(st.sampled_from(LITERALS), VALUES.map(toml_value)))
            data = data[:start] + new.encode() + data[end:]
        elif op == "line":
            lines = data.split(b"\n")
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            how = draw(st.sampled_from(["drop", "copy", "swap"]))
            if how == "drop":
                del lines[i]
            elif how == "copy":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            data = b"\n".join(lines)
        else:
            at = draw(st.integers(0, len(data)))
            if op == "delete":
                data = data[:at] + data[at + draw(st.integers(1, 8)):]
            elif op == "insert":
                data = data[:at] + draw(TEXT).encode() + data[at:]
            else:  # any bytes: invalid UTF-8, NULs, stray quotes and brackets
                data = data[:at] + draw(st.binary(min_size=1, max_size=3)) + data[at + 1:]
    return data


def cluster_files():
    return st.one_of(CLUSTER_DOCS.map(toml_document), mutated(CLUSTER_EXAMPLES))


def job_files():
    return st.one_of(JOB_DOCS.map(toml_document), mutated(JOB_EXAMPLES))


def assert_one_line_naming(message: str, path: Path):
    assert len(message.splitlines()) == 1, message
    assert message.startswith(str(path)), message


# -- the files ----------------------------------------------------------------------------------

@FUZZ
@given(text=cluster_files())
def test_any_cluster_file_loads_or_names_the_problem(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    path.write_bytes(text)
    try:
        cluster = Cluster.load(path)
    except ConfigError as e:
        assert_one_line_naming(str(e), path)
        return
    # What every later step reads must work on any cluster the loader accepts.
    assert cluster.topology().world_size == cluster.world_size
    assert cluster.rendezvous_endpoint


@FUZZ
@given(text=job_files())
def test_any_job_file_loads_or_names_the_problem(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("job") / "job.toml"
    path.write_bytes(text)
    try:
        job = Job.load(path)
    except ConfigError as e:
        assert_one_line_naming(str(e), path)
        return
    json.dumps(job.fingerprint())


# -- the CLI ------------------------------------------------------------------------------------

class _WouldRun(Exception):
    """Validation passed and the command would now start work."""


def _would_run(*args, **kwargs):
    raise _WouldRun


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "train.py").write_text("")
    (d / "bad.toml").write_text("hosts = [\n")
    (d / "empty.toml").write_text("")
    (d / "dir.toml").mkdir()
    (d / "cluster.toml").write_text('rendezvous = "a:29500"\n[[hosts]]\nname = "a"\nprocs = 2\n'
                                    '[[hosts]]\nname = "b"\naddress = "127.0.0.1"\n')
    (d / "job.toml").write_text('workload = "recommender"\n[recommender]\ntable_sizes = [100, 7]\n')
    # Brackets in a path: rich would read "[/b]" in the plan's title as a closing tag.
    (d / "x [" / "b]").mkdir(parents=True)
    (d / "x [" / "b]" / "job.toml").write_text((d / "job.toml").read_text())
    paths = [d / n for n in ("train.py", "bad.toml", "empty.toml", "dir.toml", "cluster.toml",
                             "job.toml", "x [/b]/job.toml", "missing.toml")]
    # The first plans import rich and warm torch's modules up: not what the deadline is for.
    for job, flag in ((JOB_EXAMPLES[0], "--json"), (d / "job.toml", "--job")):
        run_main(["plan", flag, "--job", str(job), "--cluster", str(d / "cluster.toml")], d)
    return d, sorted(str(p) for p in paths + CLUSTER_EXAMPLES + JOB_EXAMPLES)


@pytest.fixture
def no_launch(monkeypatch):
    for module, name in ((tilework.launch.launcher, "run"), (tilework.train.trainer, "train"),
                         (tilework.bench.suite, "run_suite"),
                         (tilework.cluster.calibrate, "measure")):
        monkeypatch.setattr(module, name, _would_run)


COMMANDS = ["run", "train", "plan", "calibrate", "bench", "demo"]
FLAGS = ["-n", "--nproc", "--hosts", "--host", "--max-restarts", "--resume", "--job", "--cluster",
         "--json", "--quick", "--steps", "--workloads", "--systems", "--out", "--out-dir",
         "--run-id", "--timeout", "--verbose", "--", "-"]
NUMBERS = ["-1", "0", "1", "2", "3", "99999999999999999999", "9" * 5000, "1e3", "nan", "inf",
           " 2 ", "٣", "²", "0x10"]
GENERATED = "generated"  # a placeholder the test replaces by a file holding the drawn bytes


def _file(kind: str):
    draw = cluster_files() if kind == "cluster" else job_files()
    return draw.map(lambda b: (GENERATED, b))


@st.composite
def _structured(draw, where: Path, files: list[str]) -> list:
    """A command close to valid, so that fuzzing reaches past argparse into each command."""
    path = st.sampled_from(files)
    cluster = st.one_of(path, _file("cluster"), st.just(str(where / "cluster.toml")))
    job = st.one_of(path, _file("job"),
                    st.sampled_from([str(where / "job.toml"), str(where / "x [/b]/job.toml")]))
    num = st.one_of(st.sampled_from(["1", "2"]), st.sampled_from(NUMBERS))
    host = st.one_of(st.sampled_from(["a", "b", "node0", "node1", "127.0.0.1"]), TEXT)
    names = st.lists(st.sampled_from(["lm100k", "cnn", "gpt", "ddp", "hybrid", "gan"]),
                     min_size=1, max_size=3)

    def maybe(*parts) -> list:
        return [draw(p) if isinstance(p, st.SearchStrategy) else p for p in parts] \
            if draw(st.booleans()) else []

    command = draw(st.sampled_from(COMMANDS))
    argv = [command]
    if command in ("run", "train"):
        argv += [draw(job)] if command == "train" else []
        argv += (["-n", draw(num)] if draw(st.booleans()) else
                 ["--hosts", draw(cluster), *maybe("--host", host)])
        argv += [*maybe("--run-id", TEXT), *maybe("--max-restarts", num),
                 *maybe("--timeout", num)]
        argv += maybe("--resume") if command == "train" else \
            [*maybe("--verbose"), draw(st.one_of(st.just(str(where / "train.py")), path, TEXT)),
             *draw(st.lists(TEXT, max_size=2))]
    elif command == "plan":
        argv += ["--job", draw(job), "--cluster", draw(cluster), *maybe("--json")]
    elif command == "calibrate":
        argv += ["--cluster", draw(cluster), *maybe("-n", num), *maybe("--quick")]
    elif command == "bench":
        argv += [*maybe("--quick"), *maybe("--workloads", *draw(names)),
                 *maybe("--systems", *draw(names)), *maybe("--steps", num), *maybe("--out", TEXT)]
    else:
        argv += [*maybe("-n", num), *maybe("--steps", num), *maybe("--out-dir", TEXT)]
    return argv


@st.composite
def argvs(draw, where: Path, files: list[str]):
    argv = draw(_structured(where, files))
    token = st.one_of(st.sampled_from(COMMANDS + FLAGS + NUMBERS), st.sampled_from(files), TEXT)
    for _ in range(draw(st.integers(1, 3)) if draw(st.booleans()) else 0):
        at = draw(st.integers(0, len(argv)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        if op == "insert":
            argv.insert(at, draw(token))
        elif at < len(argv):
            if op == "delete":
                del argv[at]
            else:
                argv[at] = draw(token)
    return argv


def run_main(argv: list, where: Path) -> tuple[int | str, str, str]:
    """main(argv) in this process: (exit code or "would run", stdout, stderr)."""
    for i, arg in enumerate(argv):
        if isinstance(arg, tuple):
            path = where / f"generated{i}.toml"
            path.write_bytes(arg[1])
            argv[i] = str(path)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except _WouldRun:
            code = "would run"
        except SystemExit as e:  # --help, or a prefix argparse expands to it: help, exit 0
            assert e.code == 0 and out.getvalue() and not err.getvalue(), (argv, err.getvalue())
            code = 0
    return code, out.getvalue(), err.getvalue()


@settings(FUZZ, max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                          HealthCheck.too_slow])
@given(data=st.data())
def test_any_command_line_runs_or_fails_in_one_line(files, no_launch, data):
    where, paths = files
    argv = data.draw(argvs(where, paths), label="argv")
    code, out, err = run_main(argv, where)
    event(f"{argv[0] if argv else ''} -> {code}")  # --hypothesis-show-statistics: how far
    if code == 2:
        assert err.startswith("tilework: error:") and len(err.splitlines()) == 1, (argv, err)
    else:
        assert code in (0, "would run") and "Traceback" not in err, (argv, code, err)


@settings(FUZZ, max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                          HealthCheck.too_slow])
@given(job=JOB_DOCS.map(toml_document), cluster=CLUSTER_DOCS.map(toml_document))
def test_plan_of_any_job_on_any_cluster(files, no_launch, job, cluster):
    """The planner models any job the loader accepts, on any cluster it accepts, in time."""
    where, _ = files
    code, out, err = run_main(["plan", "--json", "--job", (GENERATED, job),
                               "--cluster", (GENERATED, cluster)], where)
    event(f"plan -> {code}")
    if code == 0:
        json.loads(out)
    else:
        assert code == 2 and err.startswith("tilework: error:"), err
        assert len(err.splitlines()) == 1, err


# -- what the fuzzing found, as plain regression tests -------------------------------------------

CLUSTER_TEXT = (EXAMPLES / "demo-2hosts.toml").read_text()


@pytest.mark.parametrize("command, text, expected", [
    ("calibrate --cluster", CLUSTER_TEXT.replace("bandwidth_gbps = 8.0", "bandwidth_gbps = inf"),
     "links.intra.bandwidth_gbps: expected a finite number, got inf"),
    ("calibrate --cluster", CLUSTER_TEXT.replace("procs = 1", "procs = " + "9" * 5000, 1),
     "not valid TOML (Exceeds the limit"),
    ("train", "[lm]\nlayers = 100000000\nvocab = 9223372036854775808\n",
     "lm.vocab: expected a 64-bit integer"),
], ids=["inf", "5000-digit-int", "int64"])
def test_fuzz_found_cases_fail_cleanly_in_a_real_process(tmp_path, command, text, expected):
    """Through `python -m tilework`: exit code 2, one line on stderr naming file and key."""
    (tmp_path / "f.toml").write_text(text)
    r = subprocess.run([sys.executable, "-m", "tilework", *command.split(), "f.toml"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("tilework: error: f.toml: ") and expected in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


def test_more_layers_than_torch_builds_in_time_are_refused_in_the_job():
    with pytest.raises(ConfigError, match="layers: expected at most 256, got 100000000"):
        LMJob(layers=100_000_000)  # torch builds LSTM layers one by one, even on meta


@pytest.mark.parametrize("lm, expected", [
    ({"vocab": 2**62}, "sizes too large"),                    # 2**62 x 64 elements
    ({"hidden": 2**62}, "sizes too large"),                   # 4 x hidden overflows int64
])
def test_plan_refuses_a_model_it_cannot_build(lm, expected):
    with pytest.raises(PlanError, match=expected):
        report(Job(lm=LMJob(**lm)), Cluster(hosts=[Host("a", 2)]))


@pytest.mark.parametrize("mb", [5e-324, 1e-9, 1.7e308])
def test_any_positive_bucket_size_plans(mb):
    out = report(Job(parallel=ParallelConfig(bucket_mb=mb)), Cluster(hosts=[Host("a", 2)]))
    assert out["step_comm_seconds"]["allreduce"] > 0
