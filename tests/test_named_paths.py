"""Words that cannot rot (issue 62): every repository path and doc section named in a docstring, a
comment or a doc exists. Files move; prose that names them does not move with them, so a reader is sent
to a room that is gone. This test reads files only (no meshlm import) and lists every miss at once."""
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Names other projects' trees use: `torchao/float8/float8_linear.py` is torchao's file, not ours.
THIRD_PARTY = {"torch", "torchao", "torchtitan", "transformers", "megatron", "deepspeed", "nanotron",
               "picotron", "flash_attn", "triton"}
ELSEWHERE = {
    "examples",             # Megatron-LM's launch scripts (examples/sc21/SRUN.sh); meshlm has no examples/
    "shared",               # the GPU machines' shared results folder (shared/gpu/<date>/), not in git
    "docs/performance.md",  # torchtitan's benchmark page, cited with its commit; not one of meshlm's docs
}
# A project named earlier in the same clause owns a path ("torchao float8/float8_linear.py", "as torchtitan
# keeps `model.py` and `parallelize.py` apart"); a parenthesis, `;` or a sentence's end ends the claim,
# so "Megatron's --rampup-batch-size (core/facts/ramp.py)" still names ours. torch and transformers are left
# out: meshlm's prose names them beside meshlm's own files all the time.
THIRD_PARTY_WORD = re.compile(r"\b(torchtitan|torchao|megatron|deepspeed|nanotron|picotron)\b", re.I)
WINDOW = 80  # characters before a path that a project's name may claim it within
IGNORED = {".git", ".venv", ".cache", ".pytest_cache", ".whl", "build", "dist", "__pycache__", "runs"}
# Files meshlm writes at run time (into a run or checkpoint directory, or a bench output): named as
# outputs, never as repository files.
RUN_TIME = {
    "metrics.jsonl", "trace.json", "profile.json", "pipeline_trace.json",  # a run's observations
    "auto_layout.json", "link_probe.json", "config.toml", "report.png",    # a run directory's records
    "meta.json", "index.json", "full.pt",                                  # checkpoint and corpus pieces
    "config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",  # Hugging Face export
    "model.safetensors.index.json",
    "kernels.json", "ceilings.json", "headline.json", "overlap.json", "multirank.json",  # bench outputs
    "cp_kernel.json", "cp.json",
}
SOURCE_EXT = {"py", "md", "toml", "sh", "js", "html", "css"}  # what the repository is written in
DATA_EXT = {"json", "jsonl", "txt", "png", "csv", "bin", "pt", "safetensors", "yaml", "yml"}
PROSE_DIRS = ("src", "tests", "bench")

TOKEN = re.compile(r"[\w./<>~$*…{}@+-]*[\w/]")
CITE = re.compile(r"(?P<doc>[\w./-]+\.md)(?:'s)?[,:]?\s*(?:\(\s*)?(?:§\s*)?\"(?P<sec>[^\"]+)\"")
ANCHOR = re.compile(r"\]\((?P<doc>[\w./-]*\.md)#(?P<slug>[\w-]+)\)")
LINK = re.compile(r"\]\((?P<target>(?![a-z]+:)[\w./-]+)(?:#[\w-]*)?\)")


def _blocks(path):
    """Runs of (line, text) read as one: a docstring, a run of comment lines, a doc's paragraph."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        starts = set()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
                first = body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                        and isinstance(first.value.value, str):
                    starts.add((first.value.lineno, first.value.col_offset))
        comments = []
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                if comments and comments[-1][0] != tok.start[0] - 1:
                    yield comments
                    comments = []
                comments.append((tok.start[0], tok.string.lstrip("#")))
            elif tok.type == tokenize.STRING and tok.start in starts:
                yield [(tok.start[0] + i, line) for i, line in enumerate(tok.string.split("\n"))]
        if comments:
            yield comments
        return
    lines = text.split("\n")
    if path.suffix == ".toml":  # comments only: the values are read and checked by the config tests
        lines = [re.sub(r"\"[^\"]*\"", "\"\"", line).partition("#")[2] for line in lines]
    block = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            block.append((number, line))
        elif block:
            yield block
            block = []
    if block:
        yield block


def _joined(block):
    """One string for a block (so a cite may wrap), and the line each character came from."""
    parts, lines = [], []
    for number, line in block:
        part = line.strip() + " "
        parts.append(part)
        lines.extend([number] * len(part))
    return "".join(parts), lines


def _tree(root):
    """Every tail of every path the repository holds (`units.py`, `zero/units.py`, …, a module's tail
    without `.py` too), and the directory names that make a slashed word read as a path."""
    tails, anchors = set(), {"meshlm"}
    for top in root.iterdir():
        if top.name in IGNORED:
            continue
        anchors.add(top.name)
        for path in [top, *(top.rglob("*") if top.is_dir() else [])]:
            parts = path.relative_to(root).parts
            if any(p in IGNORED or p.endswith(".egg-info") for p in parts):
                continue
            if path.is_dir():
                anchors.add(path.name)
            for i in range(len(parts)):
                tail = "/".join(parts[i:])
                tails.add(tail)
                if tail.endswith(".py"):
                    tails.add(tail[:-3])
    return tails, anchors


def _claimed(before):
    """Whether another project is named earlier in the clause that ends at a path."""
    return bool(THIRD_PARTY_WORD.search(re.split(r"[;()]|\.\s", before[-WINDOW:])[-1]))


def _is_repo_name(name, anchors, before):
    """Whether a word reads as a path in this repository, not a placeholder, an output or a ratio."""
    parts = name.rstrip("/").split("/")
    if re.search(r"[<>~$*…{}@]|\.\.\.|^/|^\.\.|//", name) or (name[0] == "." and parts[0] not in anchors):
        return False  # placeholders (RUN_DIR/<piece>, ~/.cache, $VAR, …, globs), absolute paths, URLs
    if any("." in part for part in parts[:-1]) or re.fullmatch(r"[A-Z][A-Z0-9_]*", parts[0]):
        return False  # a host or version (github.com/…, U.2/E1.S), a placeholder directory (RUN_DIR/…)
    if parts[0].lower() in THIRD_PARTY or parts[-1] in RUN_TIME:
        return False
    if name in ELSEWHERE or parts[0] in ELSEWHERE or _claimed(before):
        return False
    ext = parts[-1].rpartition(".")[2] if "." in parts[-1] else ""
    if len(parts) == 1:  # a bare name: a module or script (`choices.py`); a bare `notes.md` is a fixture's
        return ext in {"py", "sh", "js"} and not name.endswith("/")
    if ext in SOURCE_EXT:
        return True
    if re.search(r"--[\w.-]+[ =]$", before):
        return False  # `--out data/pretrain`, `--png docs/img/x.png`: what a command reads or writes
    # a data file, a package (`plan/`) or a module (`parallel/optim/master.MasterOptimizer`): only under a name
    # this repository has, so that `tok/s`, `send/recv` and `runs/exp1` stay words
    return parts[0] in anchors and all(re.fullmatch(r"[a-z_][\w-]*(\.\w+)*", p) for p in parts)


def _exists(name, tails, packages):
    """Relative to the repository, src/, src/meshlm/, the naming file's directory, or a package the
    prose around it names (`zero/units.py` in a paragraph on parallel/dims/): any tail of a real path."""
    parts = name.rstrip("/").split("/")
    last = parts[-1]
    ext = last.rpartition(".")[2] if "." in last else ""
    if ext in SOURCE_EXT | DATA_EXT or name.endswith("/"):
        return name.rstrip("/") in tails
    # a module, maybe with an attribute: `train/checkpoint.Pieces` is train/checkpoint(.py or /)
    if len(parts) == 2 and "." not in last and last in packages:
        return True  # two packages joined: "plan/explore assume" is `meshlm plan` and `meshlm explore`
    return "/".join(parts[:-1] + [last.partition(".")[0]]) in tails


def _headings(doc):
    """A doc's headings as a reader sees them (lower case, no backticks or emphasis): the `#` lines and
    the bold leads of paragraphs and list items (`**The grouped search.**`, `- **Growing back.**`),
    which the code cites as sections (docs/planner.md, "Workers and the state floor")."""
    found = []
    for line in doc.read_text(encoding="utf-8").split("\n"):
        match = re.match(r"#{1,6}\s+(.*)", line) or re.match(r"(?:[-*]\s+)?\*\*(.+?)\*\*", line)
        if match:
            found.append(re.sub(r"[`*_]", "", match.group(1)).strip().rstrip(".:").lower())
    return found


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _section_misses(text, here, root):
    """(offset, message) for each cited section its doc lacks."""
    cites = [(m, m.group("sec"), False) for m in CITE.finditer(text)]
    cites += [(m, m.group("slug"), True) for m in ANCHOR.finditer(text)]
    for match, section, slug in cites:
        doc = match.group("doc")
        if _claimed(text[:match.start()]):
            continue
        found = [base / doc for base in (here, root, root / "docs") if (base / doc).is_file()]
        if not found:
            yield match.start(), f"names missing path {doc}"
            continue
        heads = _headings(found[0])
        wanted = re.sub(r"[`*_]", "", " ".join(section.split())).lower()  # normalised as the headings are
        if slug:
            ok = wanted in {_slug(h) for h in heads}
        else:  # the repository's habit: a cite is a heading's start ("Losing an island" for
            ok = any(h.startswith(wanted) for h in heads)  # "Losing an island (`on_island_loss`)")
        if not ok:
            yield match.start(), f'names missing section "{section}" of {doc}'


def named_misses(root):
    """Every `file:line: names missing path X` (or `missing section "S" of X`), sorted."""
    root = Path(root)
    tails, anchors = _tree(root)
    src = root / "src"
    packages = {p.name for p in src.glob("*/*") if p.is_dir()} if src.is_dir() else set()
    files = [p for d in PROSE_DIRS for p in sorted((root / d).rglob("*.py"))]
    files += sorted((root / "docs").rglob("*.md")) + sorted(root.glob("README.md"))
    files += sorted((root / "configs").glob("*.toml"))
    misses = set()
    for path in files:
        where = path.relative_to(root).as_posix()
        for block in _blocks(path):
            text, lines = _joined(block)
            for match in TOKEN.finditer(text):
                name = match.group(0).rstrip(".")
                if ("/" in name or "." in name) and _is_repo_name(name, anchors, text[:match.start()]) \
                        and not _exists(name, tails, packages):
                    misses.add(f"{where}:{lines[match.start()]}: names missing path {name}")
            for start, message in _section_misses(text, path.parent, root):
                misses.add(f"{where}:{lines[start]}: {message}")
            if path.suffix == ".md":  # a link's target is relative to the doc: `](img/diloco.png)`
                for match in LINK.finditer(text):
                    target = match.group("target")
                    if not (path.parent / target).exists():
                        misses.add(f"{where}:{lines[match.start()]}: names missing path {target}")
    return sorted(misses)


def test_every_named_path_and_section_exists():
    misses = named_misses(ROOT)
    assert not misses, f"{len(misses)} named paths or sections do not exist:\n" + "\n".join(misses)


def test_a_missing_path_or_section_is_reported(tmp_path):
    """The collector fails when a name rots: a fake tree where exactly three names point nowhere."""
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## Real section (`key`)\n\nSee pkg/present.py, [real](guide.md#real-section-key) and\n"
        "docs/guide.md, \"Real\nsection\"; not docs/guide.md, \"Gone section\" nor [gone](gone.md).\n")
    (tmp_path / "src" / "pkg" / "present.py").write_text(
        '"""Named: pkg/present.py and pkg/missing.py, docs/guide.md "Real section".\n\n'
        'Placeholders RUN_DIR/metrics.jsonl, ~/x.py, tok/s, as torchtitan keeps `model.py`."""\n'
        "# torch/optim/adam.py is torch's; metrics.jsonl is written at run time\n")
    assert named_misses(tmp_path) == [
        'docs/guide.md:7: names missing path gone.md',
        'docs/guide.md:7: names missing section "Gone section" of docs/guide.md',
        "src/pkg/present.py:1: names missing path pkg/missing.py",
    ]
