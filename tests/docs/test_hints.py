"""Hints that work when followed: the closing `continue:` line of a run, pasted into a shell as
printed, continues it (torchrun with its process count for a multi-process run); the README's
commands survive zsh (Hydra list overrides quoted)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, TINY, logged
from launch.torchrun import torchrun
from measure import ladder_results, ladders
from train import closing_line

RUN = ("train.log_interval=1", "train.eval_interval=2", "train.checkpoint_interval=2",
       "train.warmup_steps=0", "wandb.mode=disabled", "train.batch_size=2")  # fmt: skip


def _continue_line(output: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith("  continue: ")]
    return line.removeprefix("  continue: ")


def test_a_one_process_run_continues_with_python(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    line = _continue_line(closing_line(tmp_path, 2, 2))
    assert shlex.split(line)[:2] == ["python", "train.py"]
    assert shlex.split(line)[-1] == "train.max_steps=4"  # a number, not a `<more>` redirect


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, ["--standalone", "--nproc_per_node=2"]),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, ["--nnodes=2", "--nproc_per_node=4"]),
    ],
)
def test_a_torchrun_run_continues_with_torchrun_and_its_process_count(
    monkeypatch, tmp_path, env, words
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    command = shlex.split(_continue_line(closing_line(tmp_path / "a b", 1, 2)))
    # launch.torchrun, not stock torchrun: a Ctrl-C on the printed command exits 0, no traceback.
    launcher = ["python", "-m", "launch.torchrun"]
    assert command[:3] == launcher and command[3 : 3 + len(words)] == words
    assert command[command.index("train.py") :] == [
        "train.py", f"hydra.run.dir={tmp_path / 'a b'}", "train.resume=true"
    ]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
def test_the_continue_line_of_a_ddp_run_pasted_as_printed_resumes_it(tmp_path) -> None:
    run_dir = tmp_path / "ddp run"  # a space: the printed line must quote it
    launch = [*torchrun(2), "train.py", *TINY, *RUN, "train.max_steps=2"]
    first = subprocess.run(
        [*launch, f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    line = _continue_line(first.stdout)
    assert line.startswith("python -m launch.torchrun --standalone --nproc_per_node=2 train.py")
    # The venv's python, as on a user's PATH with the venv active.
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    second = subprocess.run(
        line, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert "finished at step 4/4" in second.stdout
    assert logged(run_dir, "train/loss") and len(logged(run_dir, "train/loss")) == 4


def unquoted_brackets(line: str) -> list[str]:
    """The words of a shell command line with a `[` outside quotes: zsh reads such a word as a
    glob pattern and fails ("no matches found") before the program starts."""
    words, word, quote, bracket = [], "", "", False
    for char in line:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char.isspace():
            words += [word] if bracket else []
            word, bracket = "", False
            continue
        elif char == "#" and not word:
            break  # a comment
        elif char == "[":
            bracket = True
        word += char
    return words + ([word] if bracket else [])


def readme_commands(text: str) -> list[str]:
    """The shell commands a reader copies: each line of a fenced bash block, and each inline code
    span that is a command (`python ...`, `torchrun ...`) or a single override."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S):
        commands += block.splitlines()
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        if span.startswith(("python ", "torchrun ")) or " " not in span:
            commands.append(span)
    return commands


def test_the_bracket_check_reads_quotes_as_the_shell_does() -> None:
    assert unquoted_brackets("python train.py +opt=[amp,compile]") == ["+opt=[amp,compile]"]
    assert unquoted_brackets("python train.py '+opt=[amp,compile]' \"extra=['+x']\"") == []
    assert unquoted_brackets("python a.py  # +opt=[amp] in a comment") == []


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_every_documented_command_quotes_its_hydra_lists_for_zsh(path: Path) -> None:
    bad = [c for c in readme_commands(path.read_text()) if unquoted_brackets(c)]
    assert not bad, f"{path.name}: quote these for zsh ('+opt=[a,b]'): {bad}"


def _documented_runs() -> list[tuple[str, int, list[str]]]:
    """Each documented `python train.py` / `python -m launch.torchrun ... train.py` run that
    starts a new job (not a sweep, a resume, a placeholder or a continued line): (command,
    processes, overrides)."""
    runs = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for command in readme_commands(path.read_text()):
            if "train.py" not in command or command.rstrip().endswith("\\"):  # continued
                continue
            words = shlex.split(command, comments=True)
            if words[:3] == ["python", "-m", "launch.torchrun"]:  # torchrun, as documented
                words = ["torchrun", *words[3:]]
            if "train.py" not in words or words[0] not in ("python", "torchrun"):
                continue
            skip = ("-m", "--help", "--cfg", "...")
            starts = ("$", "train.resume", "model.pretrained")  # a run folder, weights from the hub
            if any(w in skip or w.startswith(starts) or "<" in w for w in words):
                continue
            flags = dict(
                w.lstrip("-").split("=", 1) for w in words if w.startswith("--") and "=" in w
            )
            processes = int(flags.get("nproc_per_node", 1)) * int(flags.get("nnodes", 1))
            runs.append((command, processes, words[words.index("train.py") + 1 :]))
    return runs


@pytest.mark.parametrize(
    "command, processes, overrides",
    _documented_runs(),
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_every_documented_run_is_planned_on_its_process_count(
    command: str, processes: int, overrides: list[str]
) -> None:
    """The stages of each documented run accept its model and process count (the README once
    showed +opt=tp on GPT-2 XL, whose 25 heads do not split over 2 ranks)."""
    import warnings

    from helpers import planned

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. float16 on a CPU
        planned(processes, *overrides)


def test_the_hint_for_an_unclosed_list_suggests_an_override_that_composes() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from base.errors import hydra_message
    from helpers import make_cfg

    with pytest.raises(OverrideParseException) as e:
        OverridesParser.create().parse_overrides(["+opt=[amp,compile"])
    line = hydra_message(e.value)
    (word,) = shlex.split(line.rsplit(": ", 1)[1])  # the suggestion, as the shell passes it
    assert sorted(make_cfg(word).opt) == ["amp", "compile"], line


def test_the_readme_sweep_example_is_small() -> None:
    sweeps = [c for c in readme_commands((ROOT / "README.md").read_text()) if "train.py -m " in c]
    assert sweeps and all("train.max_steps=" in c for c in sweeps), sweeps


def test_ablate_writes_untracked_results_unless_asked_to_publish() -> None:
    default = ladders.config(["ladder=quick"])
    published = ladders.config(["ladder=quick", "publish=true"])
    assert ladder_results.results_dir(default) == Path("outputs/ablate/results")  # gitignored
    assert ladder_results.results_dir(published) == ROOT / "docs" / "results"
