"""The plugin loader: entry points of a package found on the path (a dist-info folder written
here, as pip would), filtered by TROUPE_PLUGINS, general plugins run once per process, a broken
plugin reported by name; ModelRegistry; the batch-level logits processors' bookkeeping."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from actors.engine.args import logits_processor_names
from actors.engine.sampling_params import SamplingParams
from actors.runtime import plugins
from actors.runtime.plugins import (ENDPOINTS, GENERAL_PLUGINS, PluginError, call_plugins, load_general_plugins,
                                    load_plugins_by_group)
from models.architectures import ModelRegistry
from helpers import write_distribution
from models.logits_processors import LogitsProcessors

MODULE = '''
CALLS = []
def first():
    CALLS.append("first")
def second():
    CALLS.append("second")
def add_routes(router):
    CALLS.append(("routes", router))
'''


@pytest.fixture
def fresh_plugins(monkeypatch):
    """Plugins loaded anew in this test, and again afterwards for the rest of the session."""
    monkeypatch.delenv(plugins.ENV, raising=False)
    plugins.reset_for_tests()
    yield
    plugins.reset_for_tests()


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch, fresh_plugins):
    write_distribution(tmp_path, f"[{GENERAL_PLUGINS}]\nfake_first = fakeplug_mod:first\n"
                                 f"fake_second = fakeplug_mod:second\n"
                                 f"[{ENDPOINTS}]\nfake_routes = fakeplug_mod:add_routes\n", MODULE, "fakeplug")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys
    sys.modules.pop("fakeplug_mod", None)
    yield lambda: importlib.import_module("fakeplug_mod").CALLS
    sys.modules.pop("fakeplug_mod", None)


def test_general_plugins_run_once_per_process(fake_distribution):
    load_general_plugins()
    load_general_plugins()
    calls = fake_distribution()
    assert calls.count("first") == 1 and calls.count("second") == 1


def test_troupe_plugins_loads_only_the_named_plugins_in_every_group(fake_distribution, monkeypatch):
    monkeypatch.setenv(plugins.ENV, "fake_second, troupe_example_register")
    load_general_plugins()
    assert fake_distribution() == ["second"]
    assert load_plugins_by_group(ENDPOINTS) == {}          # fake_routes is not named
    plugins.reset_for_tests()
    monkeypatch.setenv(plugins.ENV, "")                     # set but empty: none at all
    assert load_plugins_by_group(GENERAL_PLUGINS) == {}


def test_endpoint_plugins_are_called_with_the_router(fake_distribution, monkeypatch):
    monkeypatch.setenv(plugins.ENV, "fake_routes")
    router = object()
    call_plugins(ENDPOINTS, router)
    assert ("routes", router) in fake_distribution()


def test_a_plugin_that_fails_to_import_stops_loading_naming_it(tmp_path, monkeypatch, fresh_plugins):
    write_distribution(tmp_path, f"[{GENERAL_PLUGINS}]\nbroken_one = brokenplug_mod:register\n",
                       module="raise RuntimeError('no GPU driver here')\n", name="brokenplug")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"plugin 'broken_one' \(troupe.general_plugins\) failed to load.*"
                                          r"no GPU driver here"):
        load_general_plugins()


def test_a_plugin_that_fails_when_run_stops_start_up_naming_it(tmp_path, monkeypatch, fresh_plugins):
    write_distribution(tmp_path, f"[{GENERAL_PLUGINS}]\nfailing_one = failplug_mod:register\n",
                       module="def register():\n    raise ValueError('bad configuration')\n", name="failplug")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"plugin 'failing_one' .* when called: ValueError: bad configuration"):
        load_general_plugins()
    with pytest.raises(PluginError):                        # not marked as done: it fails again
        load_general_plugins()


def test_register_model_by_name_defers_the_import_until_a_checkpoint_asks(monkeypatch):
    from models import architectures
    monkeypatch.setattr(architectures, "_ARCHITECTURES", dict(architectures._ARCHITECTURES))
    ModelRegistry.register_model("NotImportedForCausalLM", "no_such_module_anywhere:Model")
    assert "NotImportedForCausalLM" in ModelRegistry.get_supported_archs()
    with pytest.raises(ValueError, match="NotImportedForCausalLM.*cannot be imported"):
        ModelRegistry.get_model_class("NotImportedForCausalLM")
    with pytest.raises(ValueError, match="give a class or 'module:Class'"):
        ModelRegistry.register_model("X", "no_colon")
    from models.registry import hf_architecture_of_gguf          # the others' GGUF files still load
    assert hf_architecture_of_gguf("llama") == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="'nonesuch' is not supported.*NotImportedForCausalLM.*cannot be imported"):
        hf_architecture_of_gguf("nonesuch")


def test_logits_processors_flag_refuses_what_is_not_a_processor_class_by_name():
    with pytest.raises(ValueError, match=r"--logits-processors 'no_such_pkg.Proc': cannot be imported"):
        logits_processor_names(["no_such_pkg.Proc"])
    with pytest.raises(ValueError, match="is not a logits processor: it lacks apply"):
        logits_processor_names(["collections.OrderedDict"])
    from troupe_example_plugins.logits import BanTokensLogitsProcessor
    assert logits_processor_names([BanTokensLogitsProcessor]) == (
        "troupe_example_plugins.logits:BanTokensLogitsProcessor",)


class Recorder:
    """A processor that records the updates it is given."""

    def __init__(self, invariant: bool) -> None:
        self.invariant, self.updates = invariant, []

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, update) -> None:
        self.updates.append(update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[:, 0] = torch.arange(logits.shape[0], dtype=logits.dtype)   # row i: its batch index
        return logits


def test_batch_updates_name_slots_added_and_removed_once_per_step():
    rec = Recorder(invariant=False)
    procs = LogitsProcessors([rec])
    p = SamplingParams(extra_args={"k": 1})
    procs.add(0, p, [1, 2], [])
    procs.add(2, p, [3], [7])
    procs.flush()
    up = rec.updates[-1]
    assert (up.batch_size, list(up.removed), [a[0] for a in up.added], list(up.moved)) == (3, [], [0, 2], [])
    assert up.added[1][2:] == ([3], [7])
    procs.flush()
    assert rec.updates[-1] is None                          # nothing changed
    procs.append_outputs(np.array([2]), [[9]])
    assert up.added[1][3] == [7, 9]                         # the output list is live
    procs.remove(0)
    procs.add(0, SamplingParams(), [5], [])                # the slot refilled in the same step
    procs.remove(2)
    procs.flush()
    up = rec.updates[-1]
    assert (up.batch_size, list(up.removed), [a[0] for a in up.added]) == (1, [2], [0])   # 0: replaced


def test_bound_processors_see_each_sampling_row_at_its_slot():
    procs = LogitsProcessors([Recorder(invariant=False)])
    for slot in (0, 1, 3):
        procs.add(slot, SamplingParams(), [1], [])
    procs.flush()
    logits = torch.zeros(2, 5)
    procs.bind(np.array([3, 1])).apply_non_argmax_invariant(logits)   # rows are slots 3 and 1
    assert logits[:, 0].tolist() == [3.0, 1.0]


def test_a_step_whose_requests_no_processor_applies_to_keeps_the_greedy_fast_path():
    """An installed processor that may move the argmax costs nothing to the steps of requests it
    does not apply to (``applies_to``): the sampler neither copies their logits nor calls it."""
    from troupe_example_plugins.logits import BanTokensLogitsProcessor

    from models.sampler import Sampler, SamplingMetadata
    ban = BanTokensLogitsProcessor(None, torch.device("cpu"), False)
    procs = LogitsProcessors([ban])
    procs.add(0, SamplingParams(temperature=0.0), [1], [])
    procs.add(1, SamplingParams(temperature=0.0, extra_args={"banned_token_ids": [4]}), [1], [])
    procs.flush()
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 9.0], [0.0, 1.0, 0.0, 0.0, 9.0]])
    plain = SamplingMetadata.from_lists([0.0])
    alone = dataclasses.replace(plain, logitsprocs=procs.bind(np.array([0])))
    assert alone.no_logits_processors
    out = Sampler()(logits[:1], alone)
    assert out.sampled_token_ids.tolist() == [4]
    both = dataclasses.replace(SamplingMetadata.from_lists([0.0, 0.0]), logitsprocs=procs.bind(np.array([0, 1])))
    assert not both.no_logits_processors
    assert Sampler()(logits, both).sampled_token_ids.tolist() == [4, 1]       # row 1 bans token 4
    procs.remove(1)
    assert procs.bind(np.array([0])).changes_argmax is False


def test_requests_a_processor_applies_to_decode_without_drafts():
    from troupe_example_plugins.logits import BanTokensLogitsProcessor
    ban = BanTokensLogitsProcessor(None, torch.device("cpu"), False)
    asking = SamplingParams(temperature=0.0, extra_args={"banned_token_ids": [5]})
    assert not LogitsProcessors([ban]).accepts_drafts(asking)
    assert LogitsProcessors([ban]).accepts_drafts(SamplingParams(temperature=0.0))
    invariant = LogitsProcessors([Recorder(invariant=True)])     # applies to every request
    assert invariant.accepts_drafts(SamplingParams(temperature=0.0))      # greedy: argmax unchanged
    assert not invariant.accepts_drafts(SamplingParams(temperature=0.8))
