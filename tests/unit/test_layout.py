"""torchpass.layout is the one place Python spells the state-directory layout,
and torchpass.checkpoint.manifest the one place that knows the manifest file
and its checksum."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from torchpass import layout
from torchpass.checkpoint import manifest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("torchpass", "tpassd", "tpassctl")
# A path component that only torchpass.layout may spell.
LAYOUT_NAMES = {layout.JOBS, layout.COORDINATOR_JSON, layout.COORDINATOR_PID, layout.COORDINATOR_LOG,
                layout.HOSTFILE, layout.EVENTS_JSON, layout.RANKS, layout.HOLD, layout.RESTORED_RANKS_OUT}
# The start or end of a formatted name that only torchpass.layout may build (job{J}, rank{R}.json, ...).
LAYOUT_PREFIXES = ("job", "rank", "restore-")
LAYOUT_SUFFIXES = (layout.RECORD_SUFFIX, layout.HANDOFF_SUFFIX, layout.EXIT_SUFFIX, ".go", ".err")


def test_the_documented_paths():
    sd, snap = Path("/s"), Path("/snap")
    assert layout.job_dir(sd, 7) == sd / "jobs/7"
    assert layout.coordinator_json(sd, 7) == sd / "jobs/7/coordinator.json"
    assert layout.coordinator_pid(sd, 7) == sd / "jobs/7/coordinator.pid"
    assert layout.coordinator_log(sd, 7) == sd / "jobs/7/coordinator.log"
    assert layout.hostfile(sd, 7) == sd / "jobs/7/hostfile"
    assert layout.events_json(sd, 7) == sd / "jobs/7/events.json"
    assert layout.restored_ranks_out(sd, 7) == sd / "jobs/7/restored-ranks.out"
    assert layout.restore_error_file(sd, 7, "m2", 1) == sd / "jobs/7/restore-m2-rank1.err"
    assert layout.restore_go_file(sd, 7, "m2", 1) == sd / "jobs/7/restore-m2-rank1.go"
    assert layout.hold_file(sd, 7, "m2", 1) == sd / "jobs/7/hold/m2.rank1"
    rd = layout.rank_records_dir(sd, 7)
    assert rd == sd / "jobs/7/ranks"
    assert layout.rank_record(rd, 7, 1) == rd / "job7/rank1.json"
    assert layout.handoff(rd, 7, 1) == rd / "job7/rank1.handoff"
    assert layout.exit_file(rd, 7, 1) == rd / "job7/rank1.exit"
    assert layout.images_dir(snap, 7, 1, 3) == snap / "job7/rank1.gen3"


def test_images_dirs_lists_one_ranks_generations(tmp_path):
    for name in ("rank1.gen2", "rank1.gen1", "rank10.gen1", "rank2.gen1"):
        (tmp_path / "job7" / name).mkdir(parents=True)
    assert [p.name for p in layout.images_dirs(tmp_path, 7, 1)] == ["rank1.gen1", "rank1.gen2"]
    assert layout.images_dirs(tmp_path, 8, 1) == []


def _spelled(path: Path, root: Path = REPO) -> list[str]:
    """Layout names a module builds paths from itself (a / "jobs", a / f"rank{r}.json", "manifest.json")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value == manifest.MANIFEST:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
            continue
        for side in (node.left, node.right):
            if isinstance(side, ast.Constant) and side.value in LAYOUT_NAMES:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {side.value!r}")
            elif isinstance(side, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in side.values)
                if text.startswith(LAYOUT_PREFIXES) or text.endswith(LAYOUT_SUFFIXES):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(side)}")
    return found


def test_the_scan_sees_a_spelled_name(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text('from pathlib import Path\nd = Path("/s") / "jobs" / f"rank{1}.json"\nm = "manifest.json"\n'
                 'ok = {"jobs": 1}["jobs"], Path("/s") / "data" / f"{1}.out"\n')
    assert sorted(s.split(": ", 1)[1] for s in _spelled(p, tmp_path)) == [
        "'jobs'", "'manifest.json'", "f'rank{1}.json'"]


def test_the_layout_and_the_manifest_each_live_in_one_module():
    home = {REPO / "torchpass" / "layout.py", REPO / "torchpass" / "checkpoint" / "manifest.py"}
    offenders = [hit for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py")) if p not in home
                 for hit in _spelled(p)]
    assert offenders == [], "use torchpass.layout / torchpass.checkpoint.manifest instead: " + "; ".join(offenders)


def test_the_checksum_is_the_manifests_sha256(tmp_path):
    (tmp_path / "pages-1.img").write_bytes(b"p" * 100)
    manifest.write_manifest(tmp_path, {"job": 1})
    assert manifest.checksum(tmp_path) == hashlib.sha256((tmp_path / "manifest.json").read_bytes()).hexdigest()
