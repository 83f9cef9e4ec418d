from indexer.demo import DEFAULT_BATCH, main


def test_demo_prints_selection_and_timings(capsys):
    main(["--device", "cpu", "--repeats", "1", "--num-heads", "2"])
    printed = capsys.readouterr().out
    assert "backend = torch" in printed
    assert printed.count("request ") == sum(2 if q > 1 else 1 for q, _ in DEFAULT_BATCH)
    assert "| run (scores + top-k)   |" in printed
    # the fresh 300-token prompt: its last token sees pages 0, 1 and its local page 2
    assert "request 2 token  299 (position   299): [0, 1, 2]" in printed
