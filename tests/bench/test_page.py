"""`kvgen bench report`: BENCHMARKS.md from the JSON files that real `kvgen bench latency|throughput`
runs write (stories260K against transformers, tiny settings, a few seconds)."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.page import INTRO, PLOT_NAME
from kvgen.bench.report import ENV_PREFIXES, ISA_FLAGS, REPO
from kvgen.cli import main
from kvgen.threads import foreign_environment

LATENCY = ["bench", "latency", "--model", "stories260k", "--threads", "1", "--prompt-len", "16", "--gen-len", "8",
           "--repeats", "1", "--bandwidth-size", "8MiB", "--compare", "hf"]
THROUGHPUT = ["bench", "throughput", "--model", "stories260k", "--threads", "1", "--num-requests", "4",
              "--prompt-len-range", "8", "16", "--output-len-range", "4", "8", "--compare", "hf", "--batch-sizes", "1,4"]
MAX_LINES = 330  # 13 runs: the intro, a glance row per peer, ~22 lines a section


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One real latency and one real throughput JSON, as `kvgen bench ... --output-dir DIR` writes them."""
    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("bench-results")
    paths = {}
    for argv in (LATENCY, THROUGHPUT):
        out = root / argv[1]
        assert main([*argv, "--output-dir", str(out)]) == 0
        paths[argv[1]] = out / f"{argv[1]}.json"
    torch.set_num_threads(threads)
    return paths


def report(*args: str | Path) -> int:
    return main(["bench", "report", *map(str, args)])


def sections(page: str) -> dict[str, str]:
    """The page's sections by the text of their `## ` heading."""
    return {part.split("\n", 1)[0]: part for part in page.split("\n## ")[1:]}


def table_rows(section: str, label: str) -> list[list[str]]:
    """The body rows (cells stripped) of the table whose first header cell is `label`."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {label} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def ratio_text(ours: float, theirs: float) -> str:
    value = ours / theirs
    return f"**{value:.2f}x**" if value >= 1 else f"{value:.2f}x"


# -- what the benches record ------------------------------------------------------------------------


def test_bench_json_records_command_commit_and_isa(runs):
    data = json.loads(runs["latency"].read_text())
    run = data["run"]
    assert run["argv"] == [*LATENCY, "--output-dir", str(runs["latency"].parent)]
    assert run["command"] == shlex.join(["kvgen", *run["argv"]])
    assert all(key.startswith(ENV_PREFIXES) for key in run["env"])
    assert set(run["env"]) <= set(foreign_environment())  # what the user set, not kvgen's own thread settings
    if (REPO / ".git").exists():
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert run["kvgen"]["commit"] == head.strip() and isinstance(run["kvgen"]["dirty"], bool)
    assert run["peers"]["transformers"]
    isa = data["machine"]["isa"]
    assert isa == [flag for flag in ISA_FLAGS if flag in isa] and data["machine"]["date"]


# -- the page ---------------------------------------------------------------------------------------


def test_page_has_a_table_per_workload_with_ratios_machine_and_command(runs, tmp_path, capsys):
    output, plots = tmp_path / "BENCHMARKS.md", tmp_path / "docs"
    assert report(runs["latency"], runs["throughput"], "--output", output, "--plots-dir", plots) == 0
    page = output.read_text()
    assert page.startswith(INTRO) and "-DGGML_AMX_INT8=OFF" in page
    assert f"![kvgen against each peer: every ratio on this page](docs/{PLOT_NAME})" in page
    assert (plots / PLOT_NAME).stat().st_size > 0
    latency, throughput = (json.loads(runs[mode].read_text()) for mode in ("latency", "throughput"))
    (_, glance), (lat_title, lat), (thr_title, thr) = sections(page).items()
    lat_ratios = [ratio_text(latency["results"]["kvgen"][key], latency["results"]["hf"][key])
                  for key in ("decode_tokens_per_s", "prefill_tokens_per_s")]
    thr_ratio = ratio_text(throughput["results"]["kvgen"]["output_tokens_per_s"],
                           throughput["results"]["hf"]["output_tokens_per_s"])
    assert [row[:5] for row in table_rows(glance, "run")] == [
        ["latency", "hf", *lat_ratios, "-"],
        ["throughput", f"hf (best batch {throughput['results']['hf']['batch_size']})", "-", "-", thr_ratio]]
    assert lat_title.startswith("stories260k, float32: latency, random prompt 16, 8 new tokens")
    assert thr_title.startswith("stories260k, float32: throughput, 4 requests, prompts 8-16, outputs 4-8")
    for key, label in (("decode_tokens_per_s", "decode tokens/s, batch 1"),
                       ("prefill_tokens_per_s", "prefill tokens/s, batch 1")):
        ((peer, _, _, shown),) = table_rows(lat, label)
        results = latency["results"]
        assert (peer, shown) == ("hf", ratio_text(results["kvgen"][key], results["hf"][key]))
    ((peer, _, _, shown),) = table_rows(thr, "output tokens/s, all requests at once")
    results = throughput["results"]
    assert peer == f"hf (best batch {results['hf']['batch_size']})"
    assert shown == ratio_text(results["kvgen"]["output_tokens_per_s"], results["hf"]["output_tokens_per_s"])
    for section, data in ((lat, latency), (thr, throughput)):
        assert "    " + " ".join([*(f"{k}={shlex.quote(v)}" for k, v in data["run"]["env"].items()),
                                  data["run"]["command"]]) in section.splitlines()
        machine = data["machine"]
        assert f"- Machine: {machine['cpu']}, {machine['usable_cores']} of {machine['logical_cores']} cores" in section
        assert " ".join(data["machine"]["isa"]) in section and data["machine"]["date"] in section
    bandwidth = latency["memory_bandwidth_bytes_per_s"] / 1e9
    assert f"memory bandwidth {bandwidth:.1f} GB/s" in lat and "memory bandwidth not measured" in thr
    assert f"wrote {output}" in capsys.readouterr().out


def test_page_prints_to_stdout_without_output(runs, capsys):
    assert report(runs["throughput"]) == 0
    assert capsys.readouterr().out.startswith("# kvgen benchmarks\n")


def test_a_full_set_stays_under_the_line_bound(runs, tmp_path):
    """docs/benchmarks.md's set: 12 latency runs and a throughput run, each with two peers."""
    paths = []
    for i, mode in enumerate(["latency"] * 12 + ["throughput"]):
        data = json.loads(runs[mode].read_text())
        data["results"]["llama.cpp"] = copy.deepcopy(data["results"]["hf"])
        data["notes"].append("llama.cpp built with AVX2, AVX512, AVX512_VNNI, AVX512_BF16, OPENMP (no AMX)")
        paths.append(tmp_path / f"{i:02d}-{mode}.json")
        paths[-1].write_text(json.dumps(data))
    output = tmp_path / "BENCHMARKS.md"
    assert report(*paths, "--output", output) == 0
    page = output.read_text()
    assert len(page.splitlines()) < MAX_LINES
    assert page.count("\n## ") == 14 and page.count("| llama.cpp |") == 24 + 12


def test_a_kv_tiers_ttft_run_is_a_section_with_its_table(tmp_path):
    """benchmarks/kv_tiers_ttft.py on stories260K (a 96-token document): its JSON renders as a section."""
    from kvgen.llm import default_model_path

    out = tmp_path / "kv-tiers-ttft.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kv_tiers_ttft.py"), "--model", str(default_model_path()),
                           "--tokens", "96", "--max-tokens", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["run"]["command"].startswith("python benchmarks/kv_tiers_ttft.py --model")
    output = tmp_path / "BENCHMARKS.md"
    assert report(out, "--output", output) == 0
    (heading, section), = [(h, s) for h, s in sections(output.read_text()).items() if "TTFT" in h]
    assert f"TTFT of a {data['settings']['prompt_tokens']}-token document" in heading
    rows = table_rows(section, "run")
    assert [r[0] for r in rows] == ["cold", "disk (after restart)", "host (after eviction)"]
    assert rows[0][2] == "**1.00x**" and all(r[4] == "yes" for r in rows)
    assert int(rows[1][3]) < int(rows[0][3].replace(",", ""))  # the restart computed only the last tokens


# -- bad input ----------------------------------------------------------------------------------------


def broken_files(runs: dict[str, Path], tmp_path: Path) -> list[tuple[Path, str]]:
    """(file, what its error says) for files that are missing, not JSON, or not a bench JSON."""
    text = runs["latency"].read_text()
    truncated, other, partial = tmp_path / "truncated.json", tmp_path / "scaling.json", tmp_path / "partial.json"
    truncated.write_text(text[: len(text) // 2])
    other.write_text(json.dumps({"mode": "scaling", "results": {}}))
    data = json.loads(text)
    del data["results"]["kvgen"]
    partial.write_text(json.dumps(data))
    return [(tmp_path / "absent.json", "no such file"), (truncated, "not JSON"),
            (other, "not the JSON of kvgen bench latency or throughput, of kvgen eval-ppl --text-set or of "
                    "benchmarks/kv_tiers_ttft.py (mode 'scaling')"),
            (partial, "a latency JSON without results.kvgen")]


def test_missing_or_corrupt_json_is_a_one_line_error(runs, tmp_path, capsys):
    output = tmp_path / "BENCHMARKS.md"
    for path, said in broken_files(runs, tmp_path):
        assert report(runs["throughput"], path, "--output", output) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"kvgen: error: {path}: {said}"), err
        assert not output.exists()
