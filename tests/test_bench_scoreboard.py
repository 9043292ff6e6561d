"""benchmarks/scoreboard.py: the issues' targets over the files of record, derived by each benchmark's own scoring."""
import json

from tests_support_bench import load_script

sb = load_script("scoreboard")


def _write(folder, name, rows, **header):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"header": header, "rows": rows}))


def test_cells_count_each_cards_targets_by_sentence(tmp_path):
    """A results tree with an MoE file on two cards and a router file on one: one column a card (the H200 first),
    one row a sentence, each cell met / checked as counted by hand from the rows; a card without the file is not a
    column of that issue; --write then --check agree, and a page edited by hand fails the check."""
    moe_rows = [
        {"case": "hy3-tp8", "variant": "bf16", "batch": 1, "impl": "evenflow", "us": 10.0, "frac_of_floor": 0.9,
         "cosine": 1.0},
        {"case": "hy3-tp8", "variant": "bf16", "batch": 1, "impl": "sglang-triton", "us": 16.0},  # 1.6x
        {"case": "hy3-tp8", "variant": "bf16", "batch": 1024, "impl": "evenflow", "us": 10.0, "frac_of_floor": 0.5,
         "cosine": 1.0},
        {"case": "hy3-tp8", "variant": "bf16", "batch": 1024, "impl": "sglang-triton", "us": 9.0},  # slower
    ]
    _write(tmp_path / "h100", "moe", moe_rows[:2], source_sha1="aaa", gpu="H100", date="2026-01-02T00:00:00Z")
    _write(tmp_path / "h200", "moe", moe_rows, source_sha1="bbb", gpu="H200", date="2026-01-03T00:00:00Z")
    router_rows = [
        {"case": "qwen3-30b-a3b", "M": 1, "impl": "evenflow", "us": 2.0, "max_abs_err": 1e-6, "topk_flips": 0,
         "frac_of_floor": 0.6},
        {"case": "qwen3-30b-a3b", "M": 1, "impl": "cublas-fp32", "us": 3.0, "topk_flips": 0},
        {"case": "qwen3-30b-a3b", "M": 1, "impl": "cublas-split2", "us": 2.2},  # 1.1x: short of 1.3x
    ]
    _write(tmp_path / "h200", "router", router_rows, source_sha1="ccc", gpu="H200", date="2026-01-04T00:00:00Z")
    page = sb.table(sb.score(tmp_path))
    assert "## issue 3" not in page  # no decode file anywhere
    assert "| target | h200 |\n" in page  # router: the H200 alone
    assert "| >= 1.3x cublas-split2 at every M | 0 / 1 |" in page
    assert "| within 2x of the floor at M <= 16 | 1 / 1 |" in page
    assert "| **all** | **4 / 5** |" in page  # error, flips, faster, split2 (missed), floor
    assert "| target | h200 | h100 |" in page
    assert "| frac_of_floor >= 0.85 (T <= 512) / 0.6 | 1 / 2 | 1 / 1 |" in page
    assert "| not slower than sglang-triton | 1 / 2 | 1 / 1 |" in page
    assert "| >= 1.5x sglang-triton at T <= 2 | 1 / 1 | 1 / 1 |" in page
    assert "| **all** | **3 / 5** | **3 / 3** |" in page
    assert "- `h200/moe.json`: sources `bbb`, H200, 2026-01-03; 2 missed" in page
    assert sb.main(["--results", str(tmp_path), "--write"]) == 0
    assert (tmp_path / "targets.md").read_text() == page
    assert sb.main(["--results", str(tmp_path), "--check"]) == 0
    (tmp_path / "targets.md").write_text(page.replace("1 / 2", "2 / 2"))
    assert sb.main(["--results", str(tmp_path), "--check"]) == 1


def test_committed_targets_page_is_what_the_committed_files_say():
    """benchmarks/results/targets.md is derived, never typed: it equals the scoring of the files beside it."""
    assert sb.main(["--check"]) == 0
