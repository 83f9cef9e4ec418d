"""``python -m eval.selection_locality``: page unions per query tile of real and random selections (CPU)."""

import json

import pytest
import torch

from eval import selection_locality as sl


def test_uniform_selection_is_a_valid_selection_of_distinct_earlier_pages():
    selection = sl.uniform_selection(3000, 2, torch.Generator().manual_seed(0))
    local = torch.arange(3000) // 128
    assert selection.shape == (3000, 2, 16) and selection.dtype == torch.int32
    assert torch.equal(selection[..., -1], local[:, None].expand(-1, 2).to(torch.int32))
    history = selection[..., :-1].long()
    assert bool(((history < local[:, None, None]) | (history == -1)).all())
    late = local >= 16
    assert bool((history[late] >= 0).all())
    assert all(len(set(row.tolist())) == 15 for row in history[late].reshape(-1, 15)[::97])
    early = history[~late]
    expected = torch.where(torch.arange(15) < local[~late][:, None, None], torch.arange(15), -1)
    assert torch.equal(early, expected.expand_as(early))


def test_mean_union_counts_distinct_pages_per_tile_after_the_first_16_pages():
    tokens = 2048 + 64
    shared = torch.arange(16, dtype=torch.int32).expand(tokens, 1, 16).clone()
    assert sl.mean_union_pages(shared, 8) == 16.0
    distinct = (torch.arange(tokens)[:, None, None] % 8 * 16 + torch.arange(16)).to(torch.int32)
    assert sl.mean_union_pages(distinct, 8) == 128.0
    with pytest.raises(ValueError, match="longer than 2048"):
        sl.mean_union_pages(shared[:2048], 8)


def test_command_reports_every_variant_on_the_trained_model(tmp_path, capsys):
    output = tmp_path / "locality.json"
    result = sl.main(["--lengths", "2400", "--tiles", "8", "--device", "cpu", "--output", str(output)])
    table = capsys.readouterr().out
    assert "| 2400 | uniform-random | - | 8 |" in table and "| 2400 | sparse | 1 | 8 |" in table
    summary = {(row["variant"], row["layer"]): row["mean_union_pages"] for row in json.loads(output.read_text())["summary"]}
    assert set(summary) == {("sparse", 1), ("sparse", 2), ("untrained-indexer", 1), ("untrained-indexer", 2),
                            ("uniform-random", None)}
    assert all(16 <= value <= 8 * 16 for value in summary.values())
    assert result["rows"][0]["tokens"] > 2048
    assert json.loads(output.read_text())["partial"] is False


def test_an_interrupted_run_keeps_its_finished_lengths(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the second length runs: valid JSON marked partial, with the first length's rows."""
    output = tmp_path / "locality.json"
    make_documents = sl.ra.make_documents

    def interrupted_at_the_second_length(tokenizer, length, *args, **kwargs):
        if length == 2500:
            raise KeyboardInterrupt
        return make_documents(tokenizer, length, *args, **kwargs)

    monkeypatch.setattr(sl.ra, "make_documents", interrupted_at_the_second_length)
    with pytest.raises(SystemExit) as exited:
        sl.run_command(["--lengths", "2400,2500", "--tiles", "8", "--device", "cpu", "--output", str(output)])
    assert exited.value.code == 130
    assert "interrupted: the finished lengths are in" in capsys.readouterr().err
    written = json.loads(output.read_text())
    assert written["partial"] is True and written["model"]
    assert {row["length"] for row in written["rows"]} == {2400} and {row["length"] for row in written["summary"]} == {2400}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locality.json"]


def test_lengths_must_leave_tiles_beyond_the_first_16_pages():
    with pytest.raises(SystemExit, match="must exceed"):
        sl.run_command(["--lengths", "2048", "--device", "cpu"])
