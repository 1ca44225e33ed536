"""The reviewer's door: README.md, ae_README.md and the Dockerfile say only what
the checkout can do.

- every ``python -m teraio.sweep|teraio.harness.fig3 +experiment=X [overrides]`` in either README
  (and the Dockerfile's CMD) names an existing ``conf/experiment/X.yaml``, composes with
  Hydra's compose API (an unknown key fails there, as on the command line), and every point
  it would run becomes a valid run config (``teraio.sweep.run_config``);
- every repository path the READMEs name exists, and every ``python -m`` module imports;
- ae_README.md has one row per claim C1-C22 of the paper (its §3 and §4 list them);
- ae_README.md reads in two hours: at most 4,000 words of prose, no sentence over 60 words
  (prose, words and sentences as ``prose_blocks`` defines them);
- the Dockerfile (no Docker engine here to build it) installs what pyproject.toml pins, at
  the same pins, for one CUDA major throughout, and copies only files that exist.
"""
from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from packaging.requirements import Requirement

import teraio.harness.compose as composition
from teraio import sweep

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
DOCS = ("README.md", "ae_README.md")
ENTRY_MODULES = ("teraio.sweep", "teraio.harness.fig3")
SLURM_PLUGIN = "hydra_plugins.hydra_submitit_launcher"
# Repository paths as the READMEs write them: a top-level file, or under a tracked folder.
PATH_RE = re.compile(r"(?<![\w./-])((?:\.ci|teraio|baselines|analysis|benchmarks|conf|scripts|tests)/[\w./-]*[\w/]"
                     r"|(?:pyproject\.toml|Dockerfile|\.dockerignore|README\.md|ae_README\.md))(?![\w-])")
OUTPUT_FLAGS = ("--out", "--out-dir")  # what follows is written by the command, not read
SHELL_STOP = {"&&", "||", ";", "|", ">", ">>", "2>&1"}


# ---------------------------------------------------------------- parsing the READMEs

def shell_texts(markdown: str) -> list[str]:
    """The shell text of ``markdown``: fenced code blocks, one entry per logical line
    (backslash continuations joined), then inline code spans."""
    texts = []
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M)
    for block in fenced:
        texts += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.S | re.M)
    texts += re.findall(r"`([^`\n]+)`", prose)
    return texts


def entry_commands(text: str) -> list[tuple[str, list[str]]]:
    """``(module, arguments)`` of each ``python -m teraio.sweep|teraio.harness.fig3`` in one line of
    shell text, the arguments ending at a shell operator or comment."""
    out = []
    for m in re.finditer(r"python3? -m (" + "|".join(re.escape(e) for e in ENTRY_MODULES) + r")(?![\w.])", text):
        try:
            words = shlex.split(text[m.end():], comments=True)
        except ValueError:  # an unbalanced quote: take the words up to it
            words = text[m.end():].split()
        args = []
        for w in words:
            if w in SHELL_STOP:
                break
            args.append(w)
        out.append((m.group(1), args))
    return out


def doc_commands() -> list[tuple[str, str, list[str]]]:
    cmds = []
    for doc in DOCS:
        for text in shell_texts((REPO / doc).read_text()):
            cmds += [(doc, module, args) for module, args in entry_commands(text)]
    return cmds


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of the Dockerfile, continuations joined, comments dropped."""
    lines = [ln for ln in (REPO / "Dockerfile").read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = "\n".join(lines).replace("\\\n", " ")
    out = []
    for ln in joined.splitlines():
        if ln.strip():
            word, _, rest = ln.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_commands() -> list[tuple[str, str, list[str]]]:
    """Entry commands in the Dockerfile's CMD (exec form)."""
    import json
    cmds = []
    for ins, rest in dockerfile_instructions():
        if ins == "CMD":
            argv = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
            cmds += [("Dockerfile", module, args) for module, args in entry_commands(shlex.join(argv))]
    return cmds


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def unique_commands() -> list[tuple[str, str, list[str]]]:
    """Each distinct command once (the claims table repeats the full sweep). A bare
    ``python -m teraio.sweep`` (no arguments) is a mention in prose, not a command."""
    seen, out = set(), []
    for doc, module, args in doc_commands() + dockerfile_commands():
        if args and (module, tuple(args)) not in seen:
            seen.add((module, tuple(args)))
            out.append((doc, module, args))
    return out


COMMANDS = unique_commands()


def _id(cmd) -> str:
    doc, module, args = cmd
    return f"{doc}:{module}:{' '.join(args)}"[:120]


# ---------------------------------------------------------------- composing a command

@pytest.fixture(scope="module")
def hydra_conf():
    """Hydra's compose API on conf/, with the sweep's resolvers. The peak estimate behind
    ``${capacity_for_pressure:...}`` builds a meta-device model per call; it is memoized
    here (same inputs, same bytes), which keeps the many fig7_h200 points fast."""
    memo: dict[str, int] = {}
    estimate = composition.estimate_unoffloaded_peak_bytes

    def cached(model, workload):
        key = repr((model, workload))
        if key not in memo:
            memo[key] = estimate(model, workload)
        return memo[key]

    composition.register_resolvers()
    with pytest.MonkeyPatch.context() as mp, \
            initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        mp.setattr(composition, "estimate_unoffloaded_peak_bytes", cached)
        yield


def covering_jobs(jobs: list[list[str]]) -> list[list[str]]:
    """A few jobs in which every value of every swept key occurs at least once (composing
    all 225 points of fig7 would take the test minutes; each key's values are what can
    be wrong)."""
    seen: set[str] = set()
    chosen = []
    for job in jobs:
        if not set(job) <= seen:
            chosen.append(job)
            seen |= set(job)
    return chosen


def compose_command(args: list[str]):
    """Compose a command's overrides as Hydra would (master config, then each point);
    returns the composed points. Raises what Hydra or the sweep raises for a bad key or
    value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parsed = OverridesParser.create().parse_overrides(args)
    # compose() takes no sweep (a,b,c): compose the master with each key's first value,
    # then let the sweep expand the real command line, as teraio.sweep.job_overrides does.
    first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
             if o.is_sweep_override() else o.input_line for o in parsed]
    master = compose("config", overrides=first, return_hydra_config=True)
    if OmegaConf.select(master, "hydra.mode") is None or str(master.hydra.mode) != "RunMode.MULTIRUN":
        return [master]
    OmegaConf.set_readonly(master, False)
    master.hydra.overrides.task = list(args)
    jobs = sweep.job_overrides(master)
    return [compose("config", overrides=job, return_hydra_config=True) for job in covering_jobs(jobs)]


def test_the_readmes_hold_commands_to_check():
    """Guards the parser: if it stopped finding commands, every test below would pass on
    nothing."""
    every = doc_commands() + dockerfile_commands()
    by_doc = {doc: [c for c in every if c[0] == doc] for doc in DOCS + ("Dockerfile",)}
    assert len(by_doc["README.md"]) >= 3, by_doc["README.md"]
    assert len(by_doc["ae_README.md"]) >= 15, len(by_doc["ae_README.md"])
    assert ("README.md", "teraio.sweep", ["+experiment=smoke"]) in by_doc["README.md"]
    assert by_doc["Dockerfile"], "no entry command in the Dockerfile's CMD"


def test_entry_commands_are_parsed_with_their_overrides():
    text = ("bash scripts/setup.sh && .venv/bin/python -m teraio.sweep +experiment=fig7 "
            "model=llama3_8b system=ideal,teraio_mixed 'hardware.ssd_dirs=[/a,/b]' && echo done  # x")
    assert entry_commands(text) == [("teraio.sweep", ["+experiment=fig7", "model=llama3_8b",
                                                      "system=ideal,teraio_mixed", "hardware.ssd_dirs=[/a,/b]"])]
    assert entry_commands("python -m teraio.sweeper x=1") == []


@pytest.mark.parametrize("cmd", COMMANDS, ids=_id)
def test_command_names_an_experiment_and_its_overrides_compose(hydra_conf, cmd):
    doc, module, args = cmd
    experiments = [a.split("=", 1)[1] for a in args if a.startswith("+experiment=")]
    assert len(experiments) <= 1, f"{doc}: `python -m {module} {' '.join(args)}` names two experiments"
    for name in experiments:
        assert (CONF / "experiment" / f"{name}.yaml").is_file(), \
            f"{doc}: conf/experiment/{name}.yaml does not exist"
    if any(a.startswith("hydra/launcher=submitit_slurm") for a in args) and not has_module(SLURM_PLUGIN):
        pytest.skip("hydra-submitit-launcher is not installed (pip install -e '.[slurm]')")
    points = compose_command(args)
    for point in points:
        if "roofline" in point:  # fig3: the traces it would load (no worker, no run config)
            for name, spec in point.roofline.models.items():
                assert spec.trace is None or (REPO / spec.trace).is_file(), f"{name}: {spec.trace}"
        else:
            sweep.run_config(point)  # resolves every interpolation: a bad fig7.point fails here


def test_a_bad_override_key_or_value_fails_composition(hydra_conf):
    """The check above can fail: an unknown key, and a value the sweep cannot resolve."""
    with pytest.raises(Exception, match="Could not override 'fig7.pointx'"):
        compose_command(["+experiment=fig7", "fig7.pointx=bs_mid"])
    with pytest.raises(Exception):
        for p in compose_command(["+experiment=fig7", "fig7.point=bs_huge", "system=ideal", "trial=0"]):
            sweep.run_config(p)


def referenced_paths(markdown: str) -> set[str]:
    """Repository paths named in ``markdown`` (code spans, code blocks, links), leaving out
    run outputs (``runs/``) and what follows an output flag."""
    paths = set()
    for text in shell_texts(markdown) + re.findall(r"\]\(([^)\s]+)\)", markdown):
        words = text.split()
        skip = {i + 1 for i, w in enumerate(words) if w in OUTPUT_FLAGS}
        skip |= {i for i, w in enumerate(words) if w.startswith(tuple(f"{f}=" for f in OUTPUT_FLAGS))}
        for i, w in enumerate(words):
            if i in skip or "<" in w or "*" in w:
                continue
            paths |= {p.rstrip(".") for p in PATH_RE.findall(w)}
    return paths


@pytest.mark.parametrize("doc", DOCS)
def test_every_referenced_file_exists(doc):
    paths = referenced_paths((REPO / doc).read_text())
    assert paths, f"{doc}: no repository path found (parser broken?)"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_path_finder_sees_paths_and_skips_outputs():
    md = ("see `benchmarks/results/teraio_core_h200.json` and [x](conf/experiment/fig7.yaml)\n"
          "```bash\npython benchmarks/plan_compile.py T --out benchmarks/results/new.json\n```\n")
    assert referenced_paths(md) == {"benchmarks/results/teraio_core_h200.json",
                                    "conf/experiment/fig7.yaml", "benchmarks/plan_compile.py"}


@pytest.mark.parametrize("doc", DOCS)
def test_every_python_module_named_imports(doc):
    modules = set()
    for text in shell_texts((REPO / doc).read_text()):
        modules |= set(re.findall(r"python3? -m ([A-Za-z_][\w.]*)", text))
    assert modules
    missing = sorted(m for m in modules if not has_module(m))
    assert not missing, f"{doc}: `python -m` of modules that do not exist: {missing}"


def test_ae_readme_has_one_row_per_claim():
    """One row per claim in the commands table, and one in the generated claims block
    (``analysis.claims``; tests/test_claims.py checks that block against the rows)."""
    text = (REPO / "ae_README.md").read_text()
    begin, end = "<!-- analysis.claims:claims begin -->", "<!-- analysis.claims:claims end -->"
    head, rest = text.split(begin, 1)
    generated, tail = rest.split(end, 1)
    for part in (head + tail, generated):
        rows = re.findall(r"^\|\s*\**C(\d+)\**\s*\|", part, flags=re.M)
        assert sorted(map(int, rows)) == list(range(1, 23)), rows


# ---------------------------------------------------------------- ae_README's length

MAX_WORDS, MAX_SENTENCE_WORDS = 4000, 60
ABBREVIATIONS = ("e.g.", "i.e.", "vs.", "cf.", "etc.", "Fig.", "Figs.", "Eq.", "No.", "al.")


def prose_blocks(markdown: str) -> list[str]:
    """The prose of a Markdown document, one string per block (a paragraph, a list item, a
    heading, a blockquote's paragraph), its lines joined.

    Left out: fenced code blocks (commands, not prose), HTML comments (the generated blocks'
    markers), and table rows (lines starting with ``|``: cells of generated tables or
    command tables, not sentences). A blockquote's ``>`` and a list item's marker are
    stripped; a blank line, a heading or a new list item ends a block."""
    text = re.sub(r"^```[^\n]*\n.*?^```[^\n]*$", "", markdown, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    blocks, current = [], []
    for line in text.splitlines():
        line = re.sub(r"^\s*(?:>\s?)+", "", line).strip()
        starts = re.match(r"(?:#+\s|[-*+]\s|\d+\.\s)", line)
        if not line or line.startswith("|") or starts:
            if current:
                blocks.append(" ".join(current))
            current = []
            if starts:
                current = [line[starts.end():].strip()]
            continue
        current.append(line)
    if current:
        blocks.append(" ".join(current))
    return [b for b in blocks if b]


def words(text: str) -> list[str]:
    """Runs of non-space characters holding a letter or a digit (so a dash or an arrow
    standing alone is no word; a code span of three tokens is three)."""
    return [w for w in text.split() if re.search(r"\w", w)]


def sentences(block: str) -> list[str]:
    """A block's sentences: it is split after ``.``, ``!`` or ``?`` (closing quotes, brackets
    and Markdown emphasis allowed) followed by a space and a capital letter, a backtick, an
    asterisk or an opening bracket, except after one of ``ABBREVIATIONS``; the block's end
    ends its last sentence. Colons and semicolons do not end a sentence."""
    parts = re.split(r"(?<=[.!?])([\"')\]*_]*)\s+(?=[A-Z`*(\[§])", block)
    out, current = [], ""
    for i in range(0, len(parts), 2):
        current += parts[i] + (parts[i + 1] if i + 1 < len(parts) else "")
        if i + 1 < len(parts) and current.split()[-1].endswith(ABBREVIATIONS):
            current += " "
            continue
        out.append(current.strip())
        current = ""
    if current.strip():
        out.append(current.strip())
    return out


def test_prose_leaves_out_code_tables_and_markers_and_splits_sentences():
    md = ("# Title\n\nOne sentence here. Another one, e.g. `this` one.\n\n"
          "| a | table row with many words |\n|---|---|\n\n```bash\npython -m x y z\n```\n"
          "<!-- marker -->\n> **Box.** 1. not a list\n> 2. **5 min.** Run `x`.\n- item one\n  goes on\n")
    blocks = prose_blocks(md)
    assert blocks == ["Title", "One sentence here. Another one, e.g. `this` one.", "**Box.** 1. not a list",
                      "**5 min.** Run `x`.", "item one goes on"]
    assert sentences(blocks[1]) == ["One sentence here.", "Another one, e.g. `this` one."]
    assert sentences(blocks[3]) == ["**5 min.**", "Run `x`."]
    assert words("a — b `c d` → 1,2") == ["a", "b", "`c", "d`", "1,2"]


def test_ae_readme_reads_in_two_hours():
    """At most MAX_WORDS words in the whole file, counted as ``wc -w`` counts them (every run
    of non-space characters: tables, commands and the generated claims table included), and
    no sentence of its prose over MAX_SENTENCE_WORDS words."""
    text = (REPO / "ae_README.md").read_text()
    assert len(text.split()) <= MAX_WORDS, f"ae_README.md has {len(text.split())} words, more than {MAX_WORDS}"
    blocks = prose_blocks(text)
    long = [(len(words(t)), t[:120]) for b in blocks for t in sentences(b) if len(words(t)) > MAX_SENTENCE_WORDS]
    assert not long, f"sentences over {MAX_SENTENCE_WORDS} words: {long}"


# ---------------------------------------------------------------- the Dockerfile

def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def pip_installs() -> list[list[str]]:
    """The words after each ``pip install`` of a RUN instruction, up to a shell operator."""
    out = []
    for ins, rest in dockerfile_instructions():
        if ins != "RUN":
            continue
        for m in re.finditer(r"pip3? install\b", rest):
            words = []
            for w in shlex.split(rest[m.end():]):
                if w in SHELL_STOP:
                    break
                words.append(w)
            out.append(words)
    return out


def requirement_words(words: list[str]) -> list[str]:
    """Requirement specifiers among pip arguments (options and their values left out)."""
    takes_value = {"--index-url", "--extra-index-url", "-i", "-c", "-r", "--constraint",
                   "--requirement", "-f", "--find-links", "--target", "--prefix"}
    reqs, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in takes_value:
            skip = True
        elif not w.startswith("-") and not w.startswith((".", "/")):
            reqs.append(w)
    return reqs


BUILD_TOOLS = {"pip", "setuptools", "wheel", "ninja"}  # what DeepSpeed's op build needs, not the project


def test_dockerfile_pins_match_pyproject():
    meta = pyproject()["project"]
    declared = [Requirement(r) for r in meta["dependencies"]]
    declared += [Requirement(r) for extra in meta["optional-dependencies"].values() for r in extra]
    by_name = {r.name.lower(): r for r in declared}
    installed = [Requirement(w) for words in pip_installs() for w in requirement_words(words)]
    assert installed, "the Dockerfile pip-installs nothing"
    for req in installed:
        name = req.name.lower()
        if name in BUILD_TOOLS:
            continue
        assert name in by_name, f"Dockerfile installs {req}, which pyproject.toml does not declare"
        ours, spec = by_name[name].specifier, req.specifier
        if str(ours).startswith("=="):
            assert spec == ours, f"{name}: Dockerfile {spec or '(unpinned)'} vs pyproject.toml {ours}"
        else:  # a range in pyproject.toml: the image pins one version inside it
            pins = [s.version for s in spec if s.operator == "=="]
            assert pins and all(ours.contains(v, prereleases=True) for v in pins), \
                f"{name}: Dockerfile {spec or '(unpinned)'} is not one version within pyproject.toml's {ours}"


def test_dockerfile_installs_the_project_with_real_extras_and_not_the_cpu_one():
    extras_known = set(pyproject()["project"]["optional-dependencies"])
    project = [w for words in pip_installs() for w in words if re.fullmatch(r"\.(\[[\w,-]+\])?", w)]
    assert project, "the Dockerfile never pip-installs the project itself (`pip install '.[...]'`)"
    for w in project:
        extras = set(re.findall(r"[\w-]+", w[1:]))
        assert extras <= extras_known, f"unknown extras {extras - extras_known}"
        assert "cpu" not in extras, "the cpu extra (triton) fights a CUDA torch's own triton pin"


def test_dockerfile_uses_one_cuda_major_and_builds_the_deepspeed_ops():
    ins = dockerfile_instructions()
    base = [rest for i, rest in ins if i == "FROM"]
    assert len(base) == 1 and ":" in base[0] and not base[0].endswith(":latest"), base
    cuda = re.search(r"cuda:(\d+)\.", base[0])
    assert cuda, f"base image {base[0]} does not name its CUDA version"
    major = cuda.group(1)
    runs = " ".join(rest for i, rest in ins if i in ("RUN", "ENV"))
    kvikio = {r for r in re.findall(r"kvikio-cu(\d+)", runs + " ".join(pyproject()["project"]["dependencies"]))}
    assert kvikio == {major}, f"kvikio for CUDA {kvikio}, image CUDA {major}"
    torch_index = re.findall(r"download\.pytorch\.org/whl/cu(\d+)", runs)
    assert torch_index and all(t.startswith(major) for t in torch_index), torch_index
    assert "libaio-dev" in runs
    ds = [rest for i, rest in ins if i == "RUN" and "deepspeed==" in rest]
    assert ds and all("DS_BUILD_AIO=1" in r and "DS_BUILD_CPU_ADAM=1" in r for r in ds), \
        "DeepSpeed must be installed with its aio and cpu_adam ops prebuilt"


def test_dockerfile_copies_only_what_exists():
    copies = [rest for i, rest in dockerfile_instructions() if i in ("COPY", "ADD")]
    assert copies
    ignored = set()
    if (REPO / ".dockerignore").exists():
        ignored = {ln.strip().rstrip("/") for ln in (REPO / ".dockerignore").read_text().splitlines()
                   if ln.strip() and not ln.startswith("#")}
    for rest in copies:
        words = [w for w in shlex.split(rest) if not w.startswith("--")]
        if rest.startswith("--from="):
            continue  # from another stage, not the build context
        for src in words[:-1]:
            assert (REPO / src).exists(), f"COPY source {src} does not exist"
            assert src.rstrip("/") not in ignored, f"COPY source {src} is excluded by .dockerignore"
