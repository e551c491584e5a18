"""Prompt datasets and the data source: loading, bad input, length filter, shuffling, resume."""

import json

import pytest
from redline.rollout.data import DataError, DataSource, PromptDataset


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def records(n):
    return [json.dumps({"prompt": f"question {i}", "label": str(i), "meta": {"id": i}}) for i in range(n)]


def test_jsonl_fields_map_onto_samples(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", records(3))
    ds = PromptDataset(path, tokenizer, input_key="prompt", label_key="label", metadata_key="meta")
    assert [s.prompt for s in ds.samples] == ["question 0", "question 1", "question 2"]
    assert [s.label for s in ds.samples] == ["0", "1", "2"]
    assert ds.samples[2].metadata == {"id": 2}
    assert ds.samples[1].tokens == tokenizer.encode("question 1")


def test_parquet_matches_jsonl(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (extra: data)")
    import pyarrow.parquet as pq

    rows = [json.loads(r) for r in records(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    from_parquet = PromptDataset(tmp_path / "p.parquet", tokenizer, metadata_key="meta")
    from_jsonl = PromptDataset(write_jsonl(tmp_path / "p.jsonl", records(4)), tokenizer, metadata_key="meta")
    assert [(s.tokens, s.label, s.metadata) for s in from_parquet.samples] == \
        [(s.tokens, s.label, s.metadata) for s in from_jsonl.samples]


def test_chat_template_wraps_string_and_message_prompts(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "hi"}), json.dumps({"prompt": messages})])
    ds = PromptDataset(path, tokenizer, apply_chat_template=True)
    assert ds.samples[0].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ds.samples[1].prompt.startswith("<|im_start|>system\nbe brief<|im_end|>\n")
    assert ds.samples[0].tokens == tokenizer.encode(ds.samples[0].prompt, add_special_tokens=False)


def test_malformed_line_raises_with_file_and_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", records(2) + ["{not json"] + records(1))
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not valid JSON"):
        PromptDataset(path, tokenizer)


def test_missing_input_key_names_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"question": "x"})])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: no key 'prompt' \(--input-key\)"):
        PromptDataset(path, tokenizer)


def test_malformed_lines_skipped_and_counted_when_asked(tmp_path, tokenizer):
    lines = records(2) + ["{not json", json.dumps([1, 2]), json.dumps({"prompt": 5})] + records(1)
    ds = PromptDataset(write_jsonl(tmp_path / "bad.jsonl", lines), tokenizer, skip_bad_records=True)
    assert len(ds) == 3 and ds.stats.skipped_bad == 3 and ds.stats.records == 3


def test_long_prompts_filtered_and_counted(tmp_path, tokenizer):
    prompts = ["a", "a b c d e f g h i j k l m n o p"]
    path = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": p}) for p in prompts])
    limit = len(tokenizer.encode(prompts[0]))
    ds = PromptDataset(path, tokenizer, max_prompt_len=limit)
    assert [s.prompt for s in ds.samples] == ["a"]
    assert ds.stats.filtered_too_long == 1


def test_unknown_suffix_rejected(tmp_path, tokenizer):
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"unsupported format '\.csv'"):
        PromptDataset(tmp_path / "p.csv", tokenizer)


@pytest.fixture
def dataset(tmp_path, tokenizer):
    return PromptDataset(write_jsonl(tmp_path / "p.jsonl", records(5)), tokenizer)


def labels(groups):
    return [g[0].label for g in groups]


def test_groups_hold_independent_copies_with_indices(dataset):
    source = DataSource(dataset, shuffle=False)
    groups = source.get_groups(2, n_samples_per_prompt=3)
    assert labels(groups) == ["0", "1"]
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]
    assert {s.group_index for s in groups[1]} == {1}
    groups[0][0].tokens.append(99)
    assert groups[0][1].tokens == dataset.samples[0].tokens


def test_epochs_visit_every_prompt_in_seeded_orders(dataset):
    source = DataSource(dataset, seed=7)
    epoch0 = labels(source.get_groups(5, 1))
    epoch1 = labels(source.get_groups(5, 1))
    assert sorted(epoch0) == sorted(epoch1) == ["0", "1", "2", "3", "4"]
    assert epoch0 != epoch1
    assert labels(DataSource(dataset, seed=7).get_groups(5, 1)) == epoch0


def test_sharded_sources_together_serve_what_one_source_serves(dataset):
    """Two data-parallel shards over 5 prompts, 4 groups each: across the epoch boundary their groups are the
    unsharded source's 8 groups (same prompts, same global indices), and no position is served twice."""
    whole = DataSource(dataset, seed=7).get_groups(8, 2)
    shards = [DataSource(dataset, seed=7, rank=r, world=2).get_groups(4, 2) for r in range(2)]
    merged = sorted((g for shard in shards for g in shard), key=lambda g: g[0].group_index)
    assert labels(merged) == labels(whole)
    assert [[s.index for s in g] for g in merged] == [[s.index for s in g] for g in whole]
    assert [g[0].group_index for g in shards[1]] == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="rank=2 world=2"):
        DataSource(dataset, rank=2, world=2)


def test_sharded_state_refuses_another_rank(dataset):
    state = DataSource(dataset, rank=1, world=2).state_dict()
    with pytest.raises(ValueError, match="rank, world"):
        DataSource(dataset, rank=0, world=2).load_state_dict(state)


def test_state_dict_resumes_the_same_sequence(dataset):
    source = DataSource(dataset, seed=3)
    source.get_groups(3, 1)
    returned = source.get_groups(1, 2)
    returned[0][0].tokens.append(7)
    source.add_groups(returned)
    state = json.loads(json.dumps(source.state_dict()))  # the state must survive a JSON round trip
    expected = source.get_groups(6, 2)

    resumed = DataSource(dataset, seed=3)
    resumed.load_state_dict(state)
    again = resumed.get_groups(6, 2)
    assert [[(s.label, s.tokens, s.index) for s in g] for g in again] == \
        [[(s.label, s.tokens, s.index) for s in g] for g in expected]


def test_returned_groups_are_served_first(dataset):
    source = DataSource(dataset, shuffle=False)
    first = source.get_groups(2, 1)
    source.add_groups(first[1:])
    assert labels(source.get_groups(2, 1)) == ["1", "2"]


# issue 22, item 9: bad data is named by file and line when it is read


def test_a_non_utf8_byte_names_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(records(1)[0].encode() + b"\n" + '{"prompt": "caf\xe9", "label": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        PromptDataset(path, tokenizer)
    assert len(PromptDataset(path, tokenizer, skip_bad_records=True)) == 1


def test_a_prompt_longer_than_the_engine_takes_is_found_at_load(tmp_path, tokenizer):
    long = json.dumps({"prompt": "word " * 50, "label": "1"})
    path = write_jsonl(tmp_path / "p.jsonl", records(2) + [long])
    with pytest.raises(DataError, match=r"p\.jsonl:3: the prompt is \d+ tokens, longer than the engine's context "
                                        r"takes \(20 tokens.*--rollout-max-prompt-len 20"):
        PromptDataset(path, tokenizer, context=20)
    kept = PromptDataset(path, tokenizer, context=20, max_prompt_len=20)  # the hint's flag drops and counts it
    assert len(kept) == 2 and kept.stats.filtered_too_long == 1


def test_a_missing_label_is_an_error_where_a_label_is_needed(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", records(1) + [json.dumps({"prompt": "no label"})])
    assert len(PromptDataset(path, tokenizer)) == 2  # a custom reward may not need one
    with pytest.raises(DataError, match=r"p\.jsonl:2: no label under 'label' \(--label-key\)"):
        PromptDataset(path, tokenizer, require_label=True)
    skipped = PromptDataset(path, tokenizer, require_label=True, skip_bad_records=True)
    assert len(skipped) == 1 and skipped.stats.skipped_bad == 1


def test_the_parquet_hint_names_the_package_to_install(tmp_path, tokenizer, monkeypatch):
    import sys

    from redline.extras import MissingExtraError

    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(MissingExtraError, match=r"needs the package 'pyarrow', which is not installed: "
                                                r"pip install 'redline\[data\]'"):
        PromptDataset(tmp_path / "p.parquet", tokenizer)
