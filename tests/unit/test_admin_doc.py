"""docs/admin.md quotes only what exists: the repository's files, the install layout (the wheel's
programs and package data, what `make -C slurm_spank install` puts in /usr/lib/slurm, the paths the
code reads under /etc/torchpass, /run/torchpass and /var/lib/torchpass), the plugstack.conf line of
the contrib template, and, in its troubleshooting table, messages the source prints (Slurm's own in
Slurm's library)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ADMIN = (REPO / "docs" / "admin.md").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VENV = "/opt/torchpass"
SITE = f"{VENV}/lib/python3.11/site-packages/"
SOURCE_DIRS = ("torchpass", "tpassd", "tpassctl", "slurm_spank", "contrib")

_REPO_PATH = r"(?:contrib|scripts|slurm_spank|tests|tpassd|tpassctl|torchpass|docs|examples)/[\w./-]*"
_INSTALLED = r"(?:/opt/torchpass|/usr/lib/slurm|/etc/torchpass|/run/torchpass|/var/lib/torchpass)[\w./-]*"
_PATH = re.compile(rf"(?<![\w/.$<-])({_INSTALLED}|{_REPO_PATH})")


def quoted_paths() -> set[str]:
    return {m.group(1).rstrip(".,;:)") for m in _PATH.finditer(ADMIN)}


def source_text() -> str:
    parts = []
    for d in SOURCE_DIRS:
        for f in sorted((REPO / d).rglob("*")):
            if f.is_file() and f.suffix in (".py", ".c", ".h", ".conf", ".service", ".slice", ".example", ""):
                parts.append(f.read_text(errors="replace"))
    return "\n".join(parts)


def section(title: str) -> str:
    start = ADMIN.index(title)
    nxt = re.search(r"^## ", ADMIN[start + len(title):], re.M)
    return ADMIN[start: start + len(title) + (nxt.start() if nxt else len(ADMIN))]


def test_it_quotes_paths_of_every_kind_checked_here():
    """The classes below each see something; a rewrite that drops them all would pass vacuously."""
    paths = quoted_paths()
    for prefix in ("contrib/", "scripts/", f"{VENV}/bin/", SITE, "/usr/lib/slurm/", "/etc/torchpass/"):
        assert any(p.startswith(prefix) for p in paths), prefix


def test_repository_paths_exist():
    missing = sorted(p for p in quoted_paths() if not p.startswith("/") and not (REPO / p).exists())
    assert not missing, f"admin.md names files the repository lacks: {missing}"


def test_venv_programs_are_the_wheels_console_scripts():
    programs = set(PYPROJECT["project"]["scripts"]) | {"pip", "python"}
    named = {p[len(f"{VENV}/bin/"):] for p in quoted_paths() if p.startswith(f"{VENV}/bin/")}
    assert named and not named - programs, f"admin.md runs {sorted(named - programs)} from {VENV}/bin"


def test_site_packages_paths_are_in_the_wheel():
    """torchpass/contrib/ is contrib/ (setup.py copies it); other data files are pyproject's package data."""
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for p in sorted(q for q in quoted_paths() if q.startswith(SITE)):
        rel = p[len(SITE):].rstrip("/")
        src = REPO / ("contrib" + rel[len("torchpass/contrib"):] if rel.startswith("torchpass/contrib") else rel)
        assert src.exists(), f"{p}: {src.relative_to(REPO)} does not exist"
        if src.is_file() and src.suffix != ".py" and not rel.startswith("torchpass/contrib"):
            pkg, _, name = rel.rpartition("/")
            while pkg and pkg.replace("/", ".") not in data:
                pkg, _, head = pkg.rpartition("/")
                name = f"{head}/{name}"
            globs = data.get(pkg.replace("/", "."), [])
            assert any(Path(name).match(g) for g in globs), f"{p} is not package data in pyproject.toml"


def test_plugin_paths_are_what_make_install_installs():
    makefile = (REPO / "slurm_spank" / "Makefile").read_text()
    installed = set(re.findall(r"install -m 0755 \$\(INSTALL_OWNER\) (\S+) \$\(DESTDIR\)\$\(LIBDIR\)/", makefile))
    named = {p[len("/usr/lib/slurm/"):] for p in quoted_paths() if p.startswith("/usr/lib/slurm/")}
    assert {"torchpass.so", "tpass-init"} <= installed
    assert named and named <= installed, f"admin.md names {sorted(named - installed)} in /usr/lib/slurm"


def test_the_codes_own_paths_are_spelled_in_the_source():
    source = source_text()
    code_paths = ("/etc/torchpass", "/run/torchpass", "/var/lib/torchpass")
    for p in sorted(q for q in quoted_paths() if q.startswith(code_paths)):
        # up to a component that stands for a value (JOBID, NODE, XXXXXX)
        fixed = re.split(r"/(?=[A-Z]{2,})", p)[0].rstrip("/")
        assert fixed in source, f"admin.md names {p}, which no source file spells"


def test_the_plugstack_line_is_the_contrib_templates():
    template = (REPO / "contrib" / "plugstack.conf.d" / "torchpass.conf").read_text()
    (line,) = [ln for ln in template.splitlines() if ln.startswith("optional ")]
    assert f"\n{line}\n" in section("## 2. The SPANK plugin"), "admin.md's plugstack.conf line is not the template's"
    args = dict(a.split("=", 1) for a in line.split()[2:])
    assert args["state_dir"].startswith("/shared/"), "the template's state_dir must be a shared directory"
    assert args["coordinator"] == f"{VENV}/bin/tpass-coordinator" and args["runtime_path"].startswith(SITE)


def troubleshooting_messages() -> list[tuple[str, bool]]:
    """(message, printed by Slurm?) for each row of the troubleshooting table."""
    rows = [ln for ln in section("## 6. Troubleshooting").splitlines() if ln.startswith("| `")]
    out = []
    for row in rows:
        first = row.split(" | ")[0]
        out.append((re.search(r"`([^`]+)`", first).group(1), "(Slurm)" in first))
    return out


def fragments(message: str) -> list[str]:
    return [f.strip() for f in message.split("...") if len(f.strip()) >= 6]


def test_every_troubleshooting_message_is_printed_by_the_source():
    messages = [m for m, slurm in troubleshooting_messages() if not slurm]
    assert len(messages) >= 8
    files = {}
    for d in SOURCE_DIRS[:4]:
        for f in (REPO / d).rglob("*"):
            if f.suffix in (".py", ".c", ".h"):
                files[f] = f.read_text(errors="replace")
    for message in messages:
        where = [f for f, text in files.items() if all(frag in text for frag in fragments(message))]
        assert where, f"no source file prints {message!r}"


@pytest.mark.host  # reads the installed Slurm's library
def test_slurms_messages_are_slurms():
    messages = [m for m, slurm in troubleshooting_messages() if slurm]
    assert messages
    libs = sorted(Path("/usr/lib").rglob("libslurmfull*.so*"))
    assert libs, "no libslurmfull: Slurm is not installed (make deps)"
    text = libs[0].read_bytes()
    for message in messages:
        for frag in fragments(message):
            assert frag.encode() in text, f"Slurm does not print {frag!r} ({libs[0]})"
