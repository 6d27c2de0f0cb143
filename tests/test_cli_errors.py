"""The command line's conventions: every usage or configuration error exits 2 with one line
`anchormesh: error: ...` naming the flag, key or variable, before any heavy import; `--version`
names the build; `status` reads its tracker from the environment; hivemind logs in our format."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "a-run-token-of-24-chars!"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANCHORMESH_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", *args], capture_output=True, text=True, timeout=timeout, env=env or _env()
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("flags")
    (d / "bad.json").write_text('{"token": ')
    (d / "other.json").write_text('{"run": "x"}')
    (d / "empty.txt").write_text("")
    (d / "binary").write_bytes(b"\xff\xfe\x00\x81")
    return d


@pytest.mark.parametrize(
    "args,env,names",
    [
        (["peer", "--no-such-flag"], {}, "--no-such-flag"),
        (["peer", "--tracker", "127.0.0.1:9", "--threads", "x"], {}, "--threads"),
        (["peer"], {}, "--tracker"),  # no tracker, no initial peers
        (["peer", "--tracker", "127.0.0.1:9"], {}, "--token"),  # no token
        (["peer", "--tracker", "127.0.0.1:9", "--token", TOKEN, "--device", "tpu"], {}, "--device"),
        (["peer", "--tracker", "127.0.0.1:9", "--token", TOKEN], {"ANCHORMESH_THREADS": "abc"}, "ANCHORMESH_THREADS"),
        (
            ["peer", "--tracker", "127.0.0.1:9", "--token", TOKEN],
            {"ANCHORMESH_LOG_FORMAT": "xml"},
            "ANCHORMESH_LOG_FORMAT",
        ),
        (["export", "--tracker", "127.0.0.1:9", "--out", "never"], {}, "--token"),
        (["status"], {}, "--tracker"),
        (["status", "--tracker", "127.0.0.1:9", "--token", "@{d}/bad.json"], {}, "--token"),
        (["status", "--tracker", "127.0.0.1:9", "--token", "@{d}/other.json"], {}, "--token"),
        (["status", "--tracker", "127.0.0.1:9", "--token", "@{d}/empty.txt"], {}, "--token"),
        (["status", "--tracker", "127.0.0.1:9", "--token", "@{d}/binary"], {}, "--token"),
        (["status", "--tracker", "127.0.0.1:9", "--token", "@{d}/missing.json"], {}, "--token"),
        (["status", "--tracker", "127.0.0.1:9", "--tls-ca", "{d}/bad.json"], {}, "--tls-ca"),
        (["bootstrap", "--config", "{d}/missing.toml", "--state-dir", "{d}/boot"], {}, "missing.toml"),
        (["bootstrap", "--set", "nonsense", "--state-dir", "{d}/boot"], {}, "--set"),
        (["config", "check", "--set", "optim.lr=fast"], {}, "optim.lr"),
        (["bench", "quality", "--quick", "--json", "r.json"], {}, "--out"),  # a result file is --out FILE
    ],
)
@pytest.mark.processes
def test_a_usage_error_exits_2_with_one_line_naming_it(
    args: list[str], env: dict[str, str], names: str, files: Path
) -> None:
    out = _cli(*[a.format(d=files) for a in args], env=_env(**env))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("anchormesh: error: ") and names in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not (files / "boot" / "bootstrap.json").exists()


@pytest.mark.processes
def test_help_runs_whatever_the_environment_holds() -> None:
    """A bad environment variable is checked by the command that reads it, not by --help."""
    out = _cli("peer", "--help", env=_env(ANCHORMESH_THREADS="abc"))
    assert out.returncode == 0 and "--threads" in out.stdout and "Traceback" not in out.stderr


@pytest.mark.processes
def test_a_bad_peer_invocation_answers_before_any_heavy_import() -> None:
    """The flags and the token are checked before torch, hivemind or transformers load."""
    probe = (
        "import sys\n"
        "from peer.cli import main\n"
        "try:\n"
        "    main(['peer', '--tracker', '127.0.0.1:9'])\n"
        "except SystemExit as exc:\n"
        "    heavy = sorted(m for m in ('torch', 'hivemind', 'transformers') if m in sys.modules)\n"
        "    print(exc.code, heavy)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=_env())
    assert out.stdout.strip() == "2 []", (out.stdout, out.stderr[-2000:])
    assert time.monotonic() - t0 < 10  # about 0.5 s on a quiet machine; the bound only catches the old 18 s


@pytest.mark.processes
def test_version_names_the_release_the_commit_and_the_wire_version() -> None:
    from peer import __version__
    from peer.build import commit
    from peer.wire.version import wire_version

    out = _cli("--version")
    assert out.returncode == 0 and out.stdout == f"anchormesh {__version__} (git {commit()}, wire {wire_version()})\n"
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if git.returncode == 0:  # a checkout: the commit is its HEAD
        assert git.stdout.startswith(commit()) and re.fullmatch(r"[0-9a-f]{7}", commit())


def _fake_git(root: Path, head: str, refs: dict[str, str] | None = None, packed: str = "") -> Path:
    git = root / ".git"
    git.mkdir(parents=True)
    (git / "HEAD").write_text(head + "\n")
    for ref, sha in (refs or {}).items():
        (git / ref).parent.mkdir(parents=True, exist_ok=True)
        (git / ref).write_text(sha + "\n")
    if packed:
        (git / "packed-refs").write_text(packed)
    return git


def test_the_commit_is_read_from_the_checkouts_git_files(tmp_path: Path) -> None:
    from peer.build import commit_of

    sha, other = "0123456789abcdef0123456789abcdef01234567", "fedcba9876543210fedcba9876543210fedcba98"
    _fake_git(tmp_path / "loose", "ref: refs/heads/main", {"refs/heads/main": sha})
    _fake_git(tmp_path / "packed", "ref: refs/heads/main", packed=f"# pack-refs\n{other} refs/heads/main\n")
    _fake_git(tmp_path / "detached", sha)
    main = _fake_git(tmp_path / "main", "ref: refs/heads/main", {"refs/heads/wt": other})
    wt_git = main / "worktrees" / "wt"  # a worktree: .git is a file, refs live in the common dir
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text("ref: refs/heads/wt\n")
    (wt_git / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {wt_git}\n")
    assert commit_of(tmp_path / "loose") == sha[:7] and commit_of(tmp_path / "detached") == sha[:7]
    assert commit_of(tmp_path / "packed") == other[:7] and commit_of(tmp_path / "wt") == other[:7]
    assert commit_of(tmp_path) is None  # no checkout
    _fake_git(tmp_path / "garbage", "not a ref")
    assert commit_of(tmp_path / "garbage") is None


def test_outside_a_checkout_the_commit_comes_from_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    from peer import build

    monkeypatch.setattr(build, "commit_of", lambda root: None)
    monkeypatch.setenv(build.COMMIT_ENV, "3f2a1bc")
    assert build.commit.__wrapped__() == "3f2a1bc"
    monkeypatch.delenv(build.COMMIT_ENV)
    assert build.commit.__wrapped__() == "unknown"
    assert build.release_of("0.1.0+3f2a1bc") == build.release_of("0.1.0") == "0.1.0"


def test_status_reads_the_tracker_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from peer.cli import main
    from peer.client import status

    seen = {}
    monkeypatch.setattr(status, "run_status", lambda tracker, as_json, watch, **kw: seen.update(tracker=tracker))
    monkeypatch.setenv("ANCHORMESH_TRACKER", "127.0.0.1:7000")
    monkeypatch.delenv("ANCHORMESH_TOKEN", raising=False)
    main(["status", "--json"])
    assert seen == {"tracker": "127.0.0.1:7000"}
    main(["status", "--tracker", "127.0.0.1:7001"])  # a flag wins over the environment
    assert seen == {"tracker": "127.0.0.1:7001"}


def test_bench_results_are_written_with_out_and_plot_reads_with_in() -> None:
    from peer.cli import _parser

    args = _parser().parse_args(["bench", "plot", "--in", "r.json", "--out", "p.png"])
    assert (str(args.measured), str(args.out)) == ("r.json", "p.png")
    args = _parser().parse_args(["bench", "quality", "--quick", "--out", "q.json"])
    assert str(args.out) == "q.json"


@pytest.mark.processes
def test_hivemind_logs_go_through_our_json_format() -> None:
    """A hivemind logger made before our setup (as at import) logs once, as our JSON line."""
    probe = (
        "from hivemind.utils.logging import get_logger\n"
        "log = get_logger('hivemind.probe')\n"
        "from peer.logs import setup_logging\n"
        "setup_logging()\n"
        "log.warning('hello from hivemind')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(ANCHORMESH_LOG_FORMAT="json"),
    )
    lines = [x for x in out.stderr.splitlines() if "hello from hivemind" in x]
    assert out.returncode == 0 and len(lines) == 1, out.stderr[-2000:]
    record = json.loads(lines[0])
    assert record["logger"] == "hivemind.probe" and record["level"] == "WARNING"
    assert record["message"] == "hello from hivemind"
