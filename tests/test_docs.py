"""The README and docs/ stay true: links resolve, nothing points outside the project, and
the excerpts of kvledger's output are what the code prints today.

An excerpt is the fenced block right after ``<!-- excerpt: NAME -->`` in README.md or
docs/*.md; the commands a reader types to get it are the fenced block right after
``<!-- commands: NAME -->``, and the test runs those very commands (with a scratch folder
for the model). An excerpt matches the output line by line, except that a line holding
only ``...`` stands for any number of lines, and ``...`` inside a line for any text in
that line (what differs between machines, such as the host's memory).
"""

from __future__ import annotations

import difflib
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hub_server import HubServer
from operator_harness import (
    deploy_and_run_preflight,
    describe,
    emulated_cluster,
    eventually,
    running_operator,
)
from spec_helpers import spec_of
from webhook_harness import admission_review, gpu_node, kubectl_says, webhook_operator

from kvledger.engine import cli
from kvledger.engine.errors import EXIT_DOES_NOT_FIT, EXIT_OK
from kvledger.engine.planner import device
from kvledger.operator.api.crd import API_VERSION, PLURAL
from kvledger.operator.local_run import local_model_path
from kvledger.operator.render.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOES_NOT_FIT = ROOT / "examples" / "does-not-fit.yaml"

# Written in pieces, so that this file does not trip its own check.
PRIVATE = ["ARCHITECTURE" + ".md", "../" + "shared", "/work/" + "shared"]
PROJECT_PATHS = ["README.md", "docs", "engine", "operator", "crds", "charts", "scripts",
                 "examples", "tests", "bench", "Makefile", "pyproject.toml", ".ci",
                 "Dockerfile", ".dockerignore"]
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}

_MARKED_BLOCK = re.compile(r"<!-- (excerpt|commands|manifest): ([\w.-]+) -->[ \t]*\n```[^\n]*\n(.*?)^```",
                           re.S | re.M)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\[[^\]]+\]:\s*(\S+)", re.M)


# -- links and private paths ------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+?)\s*#*\s*$", text, re.M)}


def _relative_links(page: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    targets = [m.group(1) or m.group(2) for m in _LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|//)", t, re.I)]


def test_the_pages_exist():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/planner.md", "docs/serving.md",
            "docs/operator.md", "docs/benchmarks.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_inside_the_repository(page: Path):
    broken = []
    for target in _relative_links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def _project_files() -> list[Path]:
    files = []
    for name in PROJECT_PATHS:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in path.rglob("*") if p.is_file()
                      and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)]
    return files


def test_no_project_file_points_at_material_users_do_not_have():
    hits = []
    for path in _project_files():
        data = path.read_bytes()
        for needle in PRIVATE:
            if needle.encode() in data:
                for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                    if needle in line:
                        hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, ("project files must not mention these (the reference is "
                      "docs/architecture.md):\n" + "\n".join(hits))


# -- excerpts ---------------------------------------------------------------------------

def _marked_blocks(kind: str) -> list[tuple[str, str, str]]:
    """(page, name, body) of every block marked ``<!-- KIND: NAME -->``."""
    out = []
    for page in PAGES:
        for match in _MARKED_BLOCK.finditer(page.read_text(encoding="utf-8")):
            if match.group(1) == kind:
                out.append((page.relative_to(ROOT).as_posix(), match.group(2), match.group(3)))
    return out


def _commands(page: str, name: str) -> list[list[str]]:
    """The command lines of ``<!-- commands: NAME -->`` on ``page`` (continuations joined,
    comments dropped), each split as the shell would."""
    bodies = [body for p, n, body in _marked_blocks("commands") if (p, n) == (page, name)]
    assert len(bodies) == 1, f"{page}: expected one '<!-- commands: {name} -->' block"
    text = re.sub(r"\\\n", " ", bodies[0])
    return [argv for argv in (shlex.split(line, comments=True) for line in text.splitlines())
            if argv]


def _kvledger_args(commands: list[list[str]], verb: str) -> list[str]:
    """The arguments of the one ``[.venv/bin/]kvledger VERB ...`` line, VERB included."""
    found = [argv[1:] for argv in commands
             if Path(argv[0]).name == "kvledger" and argv[1:2] == [verb]]
    assert len(found) == 1, f"expected one 'kvledger {verb}' command, found {len(found)}"
    return found[0]


def _matches(excerpt: str, actual: str) -> bool:
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line.strip() == "..."
        else ".*".join(re.escape(part) for part in line.rstrip().split("...")) + r"\n"
        for line in excerpt.splitlines())
    return re.fullmatch(pattern, actual) is not None


def _assert_excerpt(page: str, name: str, excerpt: str, actual: str) -> None:
    actual = "".join(line.rstrip() + "\n" for line in actual.splitlines())
    if not _matches(excerpt, actual):
        diff = "\n".join(difflib.unified_diff(excerpt.splitlines(), actual.splitlines(),
                                              f"{page} excerpt {name}", "what the code prints",
                                              lineterm=""))
        pytest.fail(f"{page}: excerpt {name!r} no longer matches the code:\n{diff}")


def _run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    """A folder holding the built-in ``tiny-llama``, as the examples' hostPath does."""
    from kvledger.engine.model.builtin import write_model

    root = tmp_path_factory.mktemp("models")
    write_model("tiny-llama", root / "tiny-llama")
    return root


@pytest.fixture(scope="module")
def sparse_70b(tmp_path_factory) -> Path:
    """The Llama-3-70B-shaped sparse checkpoint, written by the benchmark's own option."""
    model_dir = tmp_path_factory.mktemp("llama-3-70b-sparse")
    subprocess.run([sys.executable, str(ROOT / "bench" / "plan_speed.py"), "--write-only",
                    str(model_dir)], check=True, capture_output=True, timeout=60)
    return model_dir


@pytest.fixture
def no_gpu(monkeypatch):
    """Plan as on a machine without a GPU, as the excerpts were made (NVML sees none)."""
    monkeypatch.setattr(device, "probe_nvml", lambda *args, **kwargs: None)


def _tiny_refusal(page: str, name: str, capsys, model_root: Path) -> str:
    commands = _commands(page, name)
    args = _kvledger_args(commands, "run")
    manifest = ROOT / args[1]
    spec = yaml.safe_load(manifest.read_text())["spec"]
    # The reader writes the model where the manifest's hostPath volume finds it.
    written = _kvledger_args(commands, "make-model")
    assert written[1:] == ["tiny-llama", local_model_path(spec_of(spec))], written
    code, _, err = _run_cli([*args[:1], str(manifest), *args[2:], "--preflight-only",
                             "--model-path", str(model_root / "tiny-llama")], capsys)
    assert code == EXIT_DOES_NOT_FIT, err
    return err


def _plan_70b(page: str, name: str, capsys, sparse_70b: Path) -> str:
    commands = _commands(page, name)
    [write] = [argv for argv in commands if any(a.endswith("bench/plan_speed.py") for a in argv)]
    shown_dir = write[write.index("--write-only") + 1]
    args = _kvledger_args(commands, "plan")
    assert args[args.index("--model") + 1] == shown_dir, "plan the folder the checkpoint went to"
    args[args.index("--model") + 1] = str(sparse_70b)
    code, out, err = _run_cli(args, capsys)
    assert code in (EXIT_OK, EXIT_DOES_NOT_FIT), err
    return out if code == EXIT_OK else err


# excerpt name -> the kvledger verb whose output it is
PLANNED = {"tiny-refusal": "run", "70b-refusal": "plan", "70b-fits": "plan", "70b-tp4": "plan",
           "70b-cap": "plan", "70b-cap-refusal": "plan"}
DESCRIBED = {"describe-refusal"}
# the webhook's answers to the manifest block of the same name (gpus as written, then 4)
APPLIED = {"webhook-refusal": None, "webhook-warning": 4}


def test_every_excerpt_has_a_check_and_the_readme_has_the_three():
    names = [(page, name) for page, name, _ in _marked_blocks("excerpt")]
    unknown = [f"{page}: {name}" for page, name in names
               if name not in {*PLANNED, *DESCRIBED, *APPLIED}]
    assert not unknown, f"excerpts no test checks: {unknown}"
    readme = {name for page, name in names if page == "README.md"}
    assert {"tiny-refusal", "70b-refusal", "describe-refusal", "webhook-refusal"} <= readme


@pytest.mark.parametrize(("page", "name", "excerpt"),
                         [pytest.param(*b, id=f"{b[0]}:{b[1]}")
                          for b in _marked_blocks("excerpt") if b[1] in PLANNED])
def test_plan_excerpt_is_what_the_planner_prints(page, name, excerpt, capsys, no_gpu,
                                                 model_root, sparse_70b):
    if PLANNED[name] == "run":
        actual = _tiny_refusal(page, name, capsys, model_root)
    else:
        actual = _plan_70b(page, name, capsys, sparse_70b)
    _assert_excerpt(page, name, excerpt, actual)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_describe_excerpt_is_what_the_operator_reports(model_root, tmp_path):
    """examples/does-not-fit.yaml with ``gpus: 0``, through the real operator and a
    kubelet played by the kubelet test's helper, laid out by the harness's ``describe``."""
    blocks = [b for b in _marked_blocks("excerpt") if b[1] in DESCRIBED]
    manifest = yaml.safe_load(DOES_NOT_FIT.read_text())
    name, spec = manifest["metadata"]["name"], dict(manifest["spec"])
    spec.pop("gpus", None)  # the helper runs the pod on the CPU: gpus 0
    # The helper mounts the model from the temporary folder (hostPath): the admin allows it.
    async with running_operator(policy=Policy(host_paths=(tempfile.gettempdir(),))) as cluster:
        _, terminated = await deploy_and_run_preflight(cluster, name, model_root, tmp_path,
                                                       **spec)
        assert terminated["exitCode"] == EXIT_DOES_NOT_FIT, terminated["message"]

        def refused():
            obj = cluster.stored(API_VERSION, PLURAL, "default", name) or {}
            reasons = {c["type"]: c.get("reason")
                       for c in (obj.get("status") or {}).get("conditions", [])}
            warned = [e for e in cluster.events_for(name) if e.get("type") == "Warning"]
            return obj if reasons.get("Ready") == "DoesNotFit" and warned else None

        obj = await eventually(refused, what="DoesNotFit and its Warning event")
        text = describe(obj, cluster.events_for(name))
    for page, block_name, excerpt in blocks:
        _assert_excerpt(page, block_name, excerpt, text)


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
@pytest.mark.parametrize(("page", "name", "excerpt"),
                         [pytest.param(*b, id=f"{b[0]}:{b[1]}")
                          for b in _marked_blocks("excerpt") if b[1] in APPLIED])
async def test_apply_excerpt_is_what_the_webhook_answers(page, name, excerpt, sparse_70b,
                                                         tmp_path):
    """The page's ``<!-- manifest: llama-70b -->`` applied to a pool of 2 x (4 x H100 80 GB)
    and 2 x (8 x A100 40 GB) nodes: the operator's webhook over HTTPS, the 70B-shaped
    checkpoint on a hub stand-in at the manifest's uri, laid out as kubectl prints it."""
    [manifest] = [yaml.safe_load(body) for p, n, body in _marked_blocks("manifest")
                  if (p, n) == (page, "llama-70b")]
    spec = dict(manifest["spec"])
    if APPLIED[name] is not None:
        spec["gpus"] = APPLIED[name]
    repo = spec["model"]["uri"].removeprefix("hf://")
    with HubServer() as hub:
        hub.add_commit(repo, sparse_70b)
        async with emulated_cluster() as cluster:
            for i in range(2):
                await cluster.api.create("/api/v1/nodes", gpu_node(
                    f"h100-{i}", 4, 81559, "NVIDIA-H100-80GB-HBM3"))
                await cluster.api.create("/api/v1/nodes", gpu_node(
                    f"a100-{i}", 8, 40960, "NVIDIA-A100-SXM4-40GB"))
            async with webhook_operator(cluster, tmp_path / "log",
                                        policy={"hubEndpoints": [hub.url]}) as client:
                meta = manifest["metadata"]
                answer = await client.ask(admission_review(spec, name=meta["name"]))
    _assert_excerpt(page, name, excerpt, "$ kubectl apply -f llama-70b.yaml\n"
                    + kubectl_says(answer, meta["name"], "llama-70b.yaml"))
