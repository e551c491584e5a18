"""Which core attention a ``te`` model gets (CPU: TE's probe is replaced by its possible outcomes)."""

import logging
import sys
import types

import pytest

from redline.trainer.layers import te_layers
from redline.trainer.models.attention import VarlenAttention

UNFUSED = "UnfusedDotProductAttention"


@pytest.mark.parametrize("selected", ["FusedAttention", "FlashAttention"])
def test_auto_takes_te_attention_when_te_runs_a_fast_backend_that_matches(selected):
    assert te_layers.choose_attention("auto", selected, None) == "te"


@pytest.mark.parametrize("selected, problem", [
    (UNFUSED, None),  # cuDNN fused attention unavailable (the H100 case): never the unfused path
    (None, "RuntimeError: CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED"),  # the probe itself failed
    ("FusedAttention", "output differs from the reference by 1.3 of its max"),  # fast but wrong
])
def test_auto_falls_back_to_redline_attention(selected, problem):
    assert te_layers.choose_attention("auto", selected, problem) == "redline"


@pytest.mark.parametrize("requested", ["te", "redline"])
def test_an_explicit_request_is_honoured_whatever_the_probe_found(requested):
    assert te_layers.choose_attention(requested, UNFUSED, "slow") == requested


def test_an_unknown_attention_request_is_rejected():
    with pytest.raises(ValueError, match="attention='flash'"):
        te_layers.choose_attention("flash", None, None)


def test_te_backend_rejects_an_unknown_attention_before_importing_te():
    with pytest.raises(ValueError, match="expected one of"):
        te_layers.TEBackend(attention="cudnn")


@pytest.mark.parametrize("record, name", [
    ({"use_flash_attention": True, "use_fused_attention": False, "use_unfused_attention": False}, "FlashAttention"),
    ({"use_flash_attention": False, "use_fused_attention": True, "use_unfused_attention": True}, "FusedAttention"),
    ({"use_flash_attention": False, "use_fused_attention": False, "use_unfused_attention": True}, UNFUSED),
    ({"use_flash_attention": None, "use_fused_attention": None, "use_unfused_attention": None}, None),
    (None, None),
])
def test_selected_te_backend_reads_te_selection_record(record, name):
    assert te_layers.selected_te_backend(record) == name


def test_te_attention_record_is_found_in_te_module(monkeypatch):
    record = {"use_fused_attention": True}
    module = types.ModuleType(te_layers.TE_BACKENDS_MODULES[0])
    module._attention_backends = record
    monkeypatch.setitem(sys.modules, te_layers.TE_BACKENDS_MODULES[0], module)
    assert te_layers.te_attention_record() is record


def backend_without_te(attention, monkeypatch, probe_result):
    """A TEBackend whose TE-dependent parts are stand-ins: TE's attention class and the probe's outcome."""
    backend = te_layers.TEBackend.__new__(te_layers.TEBackend)
    backend.attention_request, backend.attention_impl, backend._decided = attention, None, {}
    backend._attention = lambda heads, kv_heads, head_dim: ("te attention", heads, kv_heads, head_dim)
    probes = []

    def probe(*key):
        probes.append(key)
        return probe_result
    monkeypatch.setattr(te_layers, "probe_te_attention", probe)
    return backend, probes


def test_te_model_uses_redline_attention_and_says_so_once_when_te_would_run_unfused(monkeypatch, caplog):
    backend, probes = backend_without_te("auto", monkeypatch, (UNFUSED, None))
    with caplog.at_level(logging.WARNING, logger="redline.trainer.te"):
        built = [backend.attention(32, 8, 128) for _ in range(4)]  # four layers
    assert all(isinstance(module, VarlenAttention) for module in built)
    assert backend.attention_impl == "redline:sdpa"
    assert probes == [(32, 8, 128)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and UNFUSED in warnings[0].getMessage()


def test_te_model_uses_te_attention_when_te_fused_attention_works(monkeypatch):
    backend, _ = backend_without_te("auto", monkeypatch, ("FusedAttention", None))
    assert backend.attention(32, 8, 128) == ("te attention", 32, 8, 128)
    assert backend.attention_impl == "te:FusedAttention"


def test_forcing_te_attention_onto_the_unfused_path_warns(monkeypatch, caplog):
    backend, _ = backend_without_te("te", monkeypatch, (UNFUSED, None))
    with caplog.at_level(logging.WARNING, logger="redline.trainer.te"):
        assert backend.attention(32, 8, 128)[0] == "te attention"
    assert any("expect a slow or wrong attention" in r.getMessage() for r in caplog.records)


def test_redline_attention_needs_no_probe(monkeypatch):
    backend, probes = backend_without_te("redline", monkeypatch, (None, "must not be called"))
    assert isinstance(backend.attention(16, 16, 64), VarlenAttention)
    assert probes == []


def test_a_new_head_layout_under_tensor_parallelism_is_decided_again(monkeypatch):
    backend, probes = backend_without_te("auto", monkeypatch, (UNFUSED, None))
    backend.attention(32, 8, 128)
    backend.attention(16, 4, 128)  # tp=2 rebuild
    assert probes == [(32, 8, 128), (16, 4, 128)]
