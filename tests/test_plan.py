"""`nestor plan`: candidates keep the pins (a dcn degree's too) and the global batch, the config's rules
reject with reasons, a layout that does not build is rejected and the plan goes on, a candidate whose
compiled peak passes the device's memory less the headroom is never ranked, the overlay trains, --measure
re-ranks by measured steps, the HLO's device groups are read in every form, and every calibration constant
has provenance."""

from __future__ import annotations

import math
import subprocess
import tempfile
import threading

import jax
import pytest

from nestor.cluster.connect import USER_CODE_ENV
from nestor.orchestrator.loader.config import load
from nestor.orchestrator.loop.console import Console
from nestor.orchestrator.planning import search as search_module
from nestor.orchestrator.planning.candidates import (Candidate, candidates, free_mesh, pinned_keys, rule_problem,
                                                     searched_keys)
from nestor.orchestrator.planning.cost import communication_s, crosses_hosts, ring_steps, sent_bytes
from nestor.orchestrator.planning.devices import calibration, device_for, provenance_problems
from nestor.orchestrator.planning.measure import measure
from nestor.orchestrator.planning.report import format_measured, format_plan, overlay, write_overlay
from nestor.orchestrator.planning.search import (BOUND, COMPILED_OVER, DOMINATED, HEADROOM, RANKED, RULES, UNDECIDED,
                                                 label, search)
from nestor.parallel.hlo import CollectiveOp, _groups, collective_ops
from nestor.parallel.rules import MESH_AXES
from tests.settings import ROOT, TINY
from tests.test_user_model import write_user_directory

MOE = ("moe.num_experts=4", "moe.every=2")
# a dense tiny LM whose mesh is pinned but for data x fsdp, and one rung per layout: four compiles in all
FOUR_LAYOUTS = ("mesh.pipeline=1", "mesh.context=1", "mesh.tensor=1", "model.remat=full", "train.grad_accum=1",
                "optimizer.shard_update=false")


def tiny(*overrides: str, tmp_path=None):
    run_dir = [f"run.dir={tmp_path / 'run'}"] if tmp_path else []
    return load(None, [*TINY, "cluster.launcher=inprocess", "run.compile_cache=null", *run_dir, *overrides])


def planned(*overrides: str):
    """The config `nestor plan` loads for the command line `overrides`: its mesh free, the batch's split left
    to the candidates."""
    return load(None, [*TINY, "cluster.launcher=inprocess", "run.compile_cache=null", *free_mesh(list(overrides)),
                       *overrides], device_checks=False)


def total(settings: dict, axis: str) -> int:
    return settings[f"mesh.{axis}"] * settings[f"mesh.dcn.{axis}"]


def test_candidates_keep_the_pins_and_the_global_batch_and_fill_every_device():
    overrides = [*MOE, "mesh.tensor=2", "model.remat=full", "mesh.data=-1"]
    pins = pinned_keys(overrides)
    assert pins == {"moe.num_experts", "moe.every", "mesh.tensor", "model.remat"}  # -1 pins no degree
    config = tiny(*overrides, "cluster.hosts=2", "cluster.devices_per_host=4")
    ladders = candidates(config, pins)
    settings = [candidate.as_dict() for ladder in ladders for candidate in ladder]
    assert len(ladders) > 10 and len(settings) > 50
    assert all(total(s, "tensor") == 2 and s["model.remat"] == "full" for s in settings)
    assert all(math.prod(total(s, axis) for axis in MESH_AXES) == 8 for s in settings)
    assert all(math.prod(s[f"mesh.dcn.{axis}"] for axis in MESH_AXES) == 2 for s in settings)  # one factor per host
    assert all(s["mesh.dcn.tensor"] == 1 for s in settings)  # tensor parallelism stays within a host
    assert not any(key.startswith("train.global_batch") or key.startswith("train.seq_len") for s in settings for key in s)
    assert {total(s, "expert") for s in settings} > {1}  # an MoE model is searched over experts
    dense = candidates(tiny("cluster.hosts=2", "cluster.devices_per_host=4"), set())
    assert all(total(c.as_dict(), "expert") == 1 for ladder in dense for c in ladder)
    # rungs go from the fastest to the lightest on memory: remat, then the sharded update, then accumulation
    rungs = [(c.as_dict()["train.grad_accum"], c.as_dict()["optimizer.shard_update"]) for c in ladders[0]]
    assert rungs == sorted(rungs)


def _variants(ladders, *keys: str) -> set[tuple]:
    return {tuple(ladder[0].as_dict().get(key) for key in keys) for ladder in ladders}


SCHEDULE_KEYS = ("pipeline.schedule", "pipeline.repeats")


def test_stages_are_searched_over_every_schedule_and_a_split_row_over_both_attentions():
    ladders = candidates(planned(), set())
    staged = [ladder for ladder in ladders if total(ladder[0].as_dict(), "pipeline") > 1]
    assert _variants(staged, *SCHEDULE_KEYS) == {("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("circular", 2),
                                                 ("interleaved_1f1b", 2)}  # 2 layer groups where a stage has several
    assert _variants([ladder for ladder in ladders if total(ladder[0].as_dict(), "pipeline") == 1], *SCHEDULE_KEYS) == {
        (None, None)}
    split = [ladder for ladder in ladders if total(ladder[0].as_dict(), "context") > 1]
    assert split and _variants(split, "model.context_attention") == {("all_gather",), ("ring",)}
    assert _variants([ladder for ladder in ladders if ladder not in split], "model.context_attention") == {(None,)}
    # a pin keeps its value, and a pinned repeat count goes to the schedules that read it
    for overrides, expected in (
            (["pipeline.schedule=interleaved_1f1b"], {("interleaved_1f1b", 2)}),
            (["pipeline.repeats=4"], {("circular", 4), ("interleaved_1f1b", 4)}),  # loads with a schedule reading it
            (["pipeline.repeats=1"], {("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1)}),
            (["pipeline.schedule=gpipe", "pipeline.repeats=1"], {("gpipe", 1)}),
            (["pipeline.schedule=circular", "pipeline.repeats=1"], {("circular", 1)})):  # as pinned
        pinned = [ladder for ladder in candidates(planned(*overrides), pinned_keys(overrides))
                  if total(ladder[0].as_dict(), "pipeline") > 1]
        assert _variants(pinned, *SCHEDULE_KEYS) == expected, overrides
    ring = ["model.context_attention=ring"]
    assert _variants(candidates(planned(*ring), pinned_keys(ring)), "model.context_attention") == {("ring",), (None,)}
    assert {"pipeline.repeats", "model.context_attention"} <= searched_keys(planned(), set())
    assert "model.context_attention" not in searched_keys(planned("mesh.context=1"), {"mesh.context"})


def test_a_dropless_moe_model_on_a_gpu_or_tpu_is_searched_over_both_exchanges_where_experts_split():
    dropless = (*MOE, "moe.capacity_factor=0")
    on_gpu = candidates(planned(*dropless), set(), accelerator=True)
    split = [ladder for ladder in on_gpu if total(ladder[0].as_dict(), "expert") > 1]
    assert _variants(split, "moe.exchange") == {("all_gather",), ("ragged_all_to_all",)}
    assert _variants([ladder for ladder in on_gpu if ladder not in split], "moe.exchange") == {(None,)}
    # XLA:CPU has the all-gather alone (`auto` takes it), and a model that drops tokens exchanges none
    assert _variants(candidates(planned(*dropless), set()), "moe.exchange") == {(None,)}
    assert _variants(candidates(planned(*MOE), set(), accelerator=True), "moe.exchange") == {(None,)}
    assert "moe.exchange" in searched_keys(planned(*dropless), set()) - searched_keys(planned(*MOE), set())
    settings = {**{f"mesh.{axis}": 1 for axis in MESH_AXES}, **{f"mesh.dcn.{axis}": 1 for axis in MESH_AXES},
                "mesh.pipeline": 2, "mesh.context": 2, "mesh.expert": 2, "pipeline.schedule": "interleaved_1f1b",
                "pipeline.repeats": 2, "pipeline.microbatches": 4, "model.context_attention": "ring",
                "moe.exchange": "ragged_all_to_all", "model.remat": "full", "optimizer.shard_update": False,
                "train.grad_accum": 2}
    assert label(Candidate(tuple(settings.items()), (), 0)) == (
        "pp2 cp2 ep2, interleaved_1f1b r2 m4, ring attention, ragged_all_to_all exchange, remat full, accum 2")


def test_stage_counts_compile_in_turn_each_in_order_of_its_bubble():
    ladders = [ladder for ladder in candidates(planned("mesh.pipeline=4", "pipeline.microbatches=8"),
                                               {"mesh.pipeline", "pipeline.microbatches"})
               if total(ladder[0].as_dict(), "data") == 2]
    order = [dict(ladder[0].layout)["pipeline.schedule"] for ladder in search_module.compile_order(ladders)]
    # bubbles of 4 stages and 8 micro-batches: 3/19 interleaved (2 groups), 6/30 zero-bubble, 3/11 the others
    assert order[:2] == ["circular", "interleaved_1f1b"] and order[2] == "zero_bubble"
    assert set(order[3:]) == {"gpipe", "1f1b"}
    # each stage count takes its turn: a budget that runs out has reached pipelines of every depth
    ordered = search_module.compile_order(candidates(planned(), set()))
    stages = [total(dict(ladder[0].layout), "pipeline") for ladder in ordered]
    assert stages[:4] == [1, 2, 4, 8] and sorted(stages[:8]) == [1, 1, 2, 2, 4, 4, 8, 8]
    assert stages[-1] == 2  # more 2-stage layouts than any other depth: they come last


@pytest.mark.slow
def test_every_searched_schedule_compiles_and_is_ranked_with_its_own_bubble():
    overrides = ["mesh.pipeline=2", "mesh.data=-1", "mesh.fsdp=1", "mesh.context=1", "mesh.tensor=1",
                 "pipeline.microbatches=4", "model.remat=full", "train.grad_accum=1", "optimizer.shard_update=false"]
    plan = search(tiny(*overrides), pinned_keys(overrides), budget_s=600, memory_limit_gib=1.0)
    assert plan.count(RANKED) == 5 and plan.compiles == 5
    bubbles = {dict(j.candidate.layout)["pipeline.schedule"]: j.predicted["bubble"] for j in plan.ranked}
    assert bubbles == pytest.approx({"gpipe": 1 / 5, "1f1b": 1 / 5, "zero_bubble": 2 / 14, "circular": 1 / 9,
                                     "interleaved_1f1b": 1 / 9})


def test_a_plan_loads_the_config_with_every_unpinned_degree_free():
    assert free_mesh(["mesh.data=2", "mesh.dcn.data=2", "train.steps=3"]) == [
        "mesh.pipeline=1", "mesh.fsdp=-1", "mesh.context=1", "mesh.expert=1", "mesh.tensor=1", "mesh.dcn.pipeline=1",
        "mesh.dcn.fsdp=1", "mesh.dcn.context=1", "mesh.dcn.expert=1", "mesh.dcn.tensor=1"]


def test_a_pinned_dcn_degree_is_kept_and_the_hosts_factor_goes_to_no_other_axis():
    overrides = ["mesh.dcn.fsdp=2", "cluster.hosts=2", "cluster.devices_per_host=4"]
    settings = [c.as_dict() for ladder in candidates(planned(*overrides), pinned_keys(overrides)) for c in ladder]
    assert len(settings) > 10
    assert all(s["mesh.dcn.fsdp"] == 2 and s["mesh.fsdp"] >= 1 for s in settings)
    assert all(s[f"mesh.dcn.{axis}"] == 1 for s in settings for axis in MESH_AXES if axis != "fsdp")


def test_a_config_with_remat_names_is_planned_with_its_own_named_policy():
    names = "model.remat_names=[mlp_gate,mlp_up]"
    config = planned("model.remat=minimal", names)  # as CONFIG would set it: model.remat is no pin
    plan = search(config, pinned_keys([names]), budget_s=0)
    assert {j.candidate.as_dict()["model.remat"] for j in plan.judged} == {"minimal"}
    assert not [j for j in plan.judged if (j.reason or "").startswith("model.remat")]
    assert plan.count(UNDECIDED) > 0  # layouts the rules let through, left for the compiler


def test_a_global_batch_that_divides_over_some_layouts_only_is_planned_over_those(capsys):
    from nestor.orchestrator.commands.cli import main

    code = main(["plan", str(ROOT / "configs" / "quickstart.yaml"), "cluster.hosts=1", "cluster.devices_per_host=8",
                 "train.global_batch=12", "run.compile_cache=null", "--budget-s", "0.001"])
    out = capsys.readouterr().out
    assert code == 1 and "plan for 1 x 8 cpu devices, global batch 12" in out
    assert "train.global_batch, e.g. 12 is not divisible by" in out  # layouts of 8 batch ways: rejected by the rules
    assert "undecided:" in out  # those of 1, 2 or 4 pass them


def test_a_plan_warns_of_idle_keys_the_user_set_but_not_of_the_keys_it_searches(capsys):
    from nestor.orchestrator.commands.cli import main

    quickstart = [str(ROOT / "configs" / "quickstart.yaml"), "cluster.hosts=1", "cluster.devices_per_host=8",
                  "cluster.launcher=inprocess", "cluster.max_failures=5", "run.compile_cache=null",
                  "--budget-s", "0.001"]
    main(["plan", *quickstart])
    err = capsys.readouterr().err
    assert "warning: these keys do nothing in this run: cluster.max_failures (cluster.launcher=inprocess" in err
    assert "pipeline.microbatches" not in err  # the plan may choose a pipeline: the quickstart's micro-batches count
    main(["plan", *quickstart, "mesh.pipeline=1"])
    assert "pipeline.microbatches (mesh.pipeline=1: no pipeline)" in capsys.readouterr().err


def test_a_layout_the_users_model_does_not_build_on_is_rejected_and_the_plan_goes_on(tmp_path, monkeypatch):
    directory = write_user_directory(tmp_path / "project")
    monkeypatch.chdir(directory)
    monkeypatch.setenv(USER_CODE_ENV, str(directory))
    overrides = ["mesh.pipeline=1", "mesh.tensor=1", "model.remat=full", "train.grad_accum=1",
                 "optimizer.shard_update=false", "model.args.width=30"]  # 30 splits over fsdp 1 and 2, not 4 or 8
    config = load("my.yaml", ["cluster.launcher=inprocess", "cluster.devices_per_host=8", *free_mesh(overrides),
                              *overrides], device_checks=False)
    plan = search(config, pinned_keys(overrides), budget_s=600)  # the first layout compiled is fsdp 8's
    refused = {total(j.candidate.as_dict(), "fsdp"): j.reason for j in plan.judged if j.verdict == RULES}
    assert sorted(refused) == [4, 8] and all("does not split over mesh.fsdp" in r for r in refused.values())
    assert sorted(total(j.candidate.as_dict(), "fsdp") for j in plan.ranked) == [1, 2]
    assert plan.usable_bytes is not None  # the device's memory, from the first layout that builds


def test_nestor_plan_prints_the_rejections_and_exits_1_when_nothing_was_ranked(capsys, tmp_path):
    from nestor.orchestrator.commands.cli import main

    code = main(["plan", str(ROOT / "configs" / "quickstart.yaml"), "cluster.hosts=1", "cluster.devices_per_host=8",
                 "run.compile_cache=null", "--budget-s", "0.001", "--out", str(tmp_path / "plan.yaml")])
    out = capsys.readouterr().out
    assert code == 1 and not (tmp_path / "plan.yaml").exists()
    assert "plan for 1 x 8 cpu devices, global batch 16" in out and "no candidate fits" in out
    assert "rejected, rules:" in out and "undecided:" in out


def test_the_configs_rules_reject_a_candidate_with_the_key_and_the_reason():
    config = tiny()
    settings = dict(candidates(config, set())[0][0].settings) | {"mesh.tensor": 8, "mesh.data": 1}
    _, reason = rule_problem(config, settings)
    assert reason.startswith("model.num_heads: 4 is not divisible by mesh.tensor=8")


def test_a_search_without_time_judges_only_by_rules_and_leaves_the_rest_undecided():
    config = tiny(*MOE)
    plan = search(config, set(), budget_s=0)
    assert plan.compiles == 0 and plan.ranked == []
    rejected = [j for j in plan.judged if j.verdict == RULES]
    assert rejected and all(j.reason and ": " in j.reason for j in rejected)
    assert plan.count(UNDECIDED) == len(plan.judged) - len(rejected) > 0
    text = format_plan(config, plan, 5)
    assert f"rejected, rules: {len(rejected)}" in text and "undecided:" in text
    assert "model.num_heads" in text  # counted by the key the rule names


@pytest.fixture(scope="module")
def roomy():
    """The four data x fsdp layouts compiled once with room to spare: their peaks per device."""
    config = tiny(*FOUR_LAYOUTS)
    plan = search(config, pinned_keys(list(FOUR_LAYOUTS)), budget_s=600, memory_limit_gib=1.0)
    return config, plan


def test_every_layout_that_fits_is_ranked_by_its_predicted_step(roomy):
    config, plan = roomy
    assert plan.count(RANKED) == 4 and plan.compiles == 4
    steps = [j.predicted["step_s"] for j in plan.ranked]
    assert steps == sorted(steps) and all(step > 0 for step in steps)
    for judged in plan.ranked:
        p = judged.predicted
        assert p["step_s"] == pytest.approx(p["compute_s"] + p["within_host_s"] + p["across_hosts_s"])
        assert judged.memory["peak"] >= judged.memory["temporaries"] > 0
    text = format_plan(config, plan, 2)
    assert text.count(" remat full") == 2  # the top 2 only


@pytest.mark.slow
def test_compiles_in_parallel_judge_as_one_at_a_time(roomy, monkeypatch):
    config, one_at_a_time = roomy
    monkeypatch.setattr(search_module, "_COMPILED", {})  # compiled afresh
    compile_figures, running, most, both = search_module._compiled_figures, [0], [0], threading.Event()

    def counted(*args):
        running[0] += 1
        most[0] = max(most[0], running[0])
        if running[0] == 2:
            both.set()
        if not both.wait(timeout=120):  # the first compile waits for a second to start: one at a time times out
            both.set()
        try:
            return compile_figures(*args)
        finally:
            running[0] -= 1

    monkeypatch.setattr(search_module, "_compiled_figures", counted)
    plan = search(config, pinned_keys(list(FOUR_LAYOUTS)), budget_s=600, memory_limit_gib=1.0, workers=2)
    assert most[0] == 2 and plan.compiles == 4  # two at once
    figures = lambda p: {j.candidate: (j.predicted, j.memory) for j in p.ranked}  # noqa: E731
    assert figures(plan) == figures(one_at_a_time)


def test_collectives_whose_groups_span_two_hosts_are_costed_over_the_network(roomy):
    _, one_host = roomy
    assert all(j.predicted["across_hosts_s"] == 0 for j in one_host.ranked)
    overrides = ["mesh.pipeline=1", "mesh.context=1", "mesh.tensor=1", "mesh.fsdp=1", "mesh.data=-1", "model.remat=full",
                 "train.grad_accum=1", "optimizer.shard_update=false", "cluster.hosts=2", "cluster.devices_per_host=4"]
    plan = search(tiny(*overrides), pinned_keys(overrides), budget_s=600, memory_limit_gib=1.0)
    (data8,) = plan.ranked
    assert data8.candidate.as_dict()["mesh.dcn.data"] == 2  # the hosts' factor is data's
    assert data8.predicted["across_hosts_s"] > 0  # the gradients' all-reduce joins both hosts


def test_a_candidate_over_the_memory_less_headroom_is_never_ranked(roomy):
    config, plan = roomy
    peaks = sorted(j.memory["peak"] for j in plan.ranked)
    assert peaks[0] < peaks[-1]  # data parallelism keeps the whole state on each device
    limit_gib = (peaks[0] + peaks[-1]) / 2 / (1 - HEADROOM) / 2**30
    tight = search(config, pinned_keys(list(FOUR_LAYOUTS)), budget_s=600, memory_limit_gib=limit_gib)
    assert tight.usable_bytes == int(limit_gib * 2**30 * (1 - HEADROOM))
    assert 0 < tight.count(RANKED) < 4 and tight.count(COMPILED_OVER) + tight.count(BOUND) == 4 - tight.count(RANKED)
    assert all(j.memory["peak"] <= tight.usable_bytes for j in tight.ranked)
    over = [j for j in tight.judged if j.verdict in (COMPILED_OVER, BOUND)]
    assert all(j.memory["peak" if j.verdict == COMPILED_OVER else "state"] > tight.usable_bytes for j in over)
    nothing = search(config, pinned_keys(list(FOUR_LAYOUTS)), budget_s=600, memory_limit_gib=peaks[0] / 2**31)
    assert nothing.ranked == [] and "no candidate fits" in format_plan(config, nothing, 5)


def test_a_layouts_later_rungs_wait_until_its_earlier_one_is_over_memory():
    overrides = ["mesh.pipeline=1", "mesh.context=1", "mesh.tensor=1", "mesh.data=1", "mesh.fsdp=-1",
                 "train.grad_accum=1", "optimizer.shard_update=false"]
    pins = pinned_keys(overrides)
    config = tiny(*overrides)
    plan = search(config, pins, budget_s=600, memory_limit_gib=1.0)
    assert [j.verdict for j in plan.judged] == [RANKED, DOMINATED, DOMINATED]  # remat none, then dots and full
    assert plan.ranked[0].candidate.as_dict()["model.remat"] == "none"


def test_lighter_remat_with_more_accumulation_is_judged_at_once_after_the_fastest_fit_else_after_every_layout(
        monkeypatch):
    """Remat none and dots are over memory at accumulation 1 and full fits; dots fits at accumulation 2 and is
    faster, and ranks in full's place (but in the first layout, where it is slower). A layout that holds the
    fastest fit so far (the first, also after its slower dots fits, and the third) has its lighter rungs judged
    at once, any other after every layout's first fit. Rungs with no less recompute than one that fits are never
    judged. (A stand-in for the compiler: the search's order alone.)"""
    overrides = ["mesh.pipeline=1", "mesh.context=1", "mesh.tensor=1", "optimizer.shard_update=false"]
    config = tiny(*overrides)
    fits = {("full", 1): 1.3, ("dots", 2): 1.1, ("full", 2): 1.0, ("full", 4): 1.0, ("dots", 4): 1.0}
    order = []

    def judge(config, candidate, devices, usable, device):
        settings = candidate.as_dict()
        rung = (settings["model.remat"], settings["train.grad_accum"])
        order.append((candidate.layout, rung))
        if rung not in fits:
            return search_module.Judged(candidate, COMPILED_OVER, "over", {"peak": 2})
        at = list(dict.fromkeys(layout for layout, _ in order)).index(candidate.layout)
        factor = 1.0 if at == 0 else 0.5 if at == 2 else 1.2  # the first and the third lead when they fit
        step_s = 1.4 if (at, rung) == (0, ("dots", 2)) else fits[rung] * factor
        return search_module.Judged(candidate, RANKED, None, {"peak": 1}, {"step_s": step_s})

    monkeypatch.setattr(search_module, "_prepare", judge)
    lines = []
    plan = search(config, pinned_keys(overrides), budget_s=600, memory_limit_gib=1.0, progress=lines.append)
    layouts = list(dict.fromkeys(layout for layout, _ in order))
    assert len(layouts) > 3
    reached = [int(line.split("/")[0].lstrip("[")) for line in lines]  # "[3/4 layouts, ...": every one counted once
    assert reached == sorted(reached) and reached[-1] == len(layouts) and len(lines) == len(order)
    first, lighter = [("none", 1), ("dots", 1), ("full", 1)], [("none", 2), ("dots", 2), ("none", 4)]
    expected = [(layouts[0], rung) for rung in first + lighter] + [(layouts[1], rung) for rung in first]
    expected += [(layouts[2], rung) for rung in first + lighter]
    expected += [(layout, rung) for layout in layouts[3:] for rung in first]
    # the others' lighter rungs, each one's next again at the back once its dots at accumulation 2 fits
    deferred = [layouts[1], *layouts[3:]]
    expected += [(layout, rung) for layout in deferred for rung in lighter[:2]] + [(l, lighter[2]) for l in deferred]
    assert order == expected
    ranked = {j.candidate.layout: (j.candidate.as_dict()["model.remat"], j.candidate.as_dict()["train.grad_accum"])
              for j in plan.ranked}
    assert len(plan.ranked) == len(layouts) and ranked == {layout: ("full", 1) if layout == layouts[0] else ("dots", 2)
                                                           for layout in layouts}
    assert len(plan.judged) == 9 * len(layouts)  # every rung judged or passed over once
    passed = [j for j in plan.judged if j.verdict == DOMINATED]
    assert sorted((j.candidate.as_dict()["model.remat"], j.candidate.as_dict()["train.grad_accum"], j.reason)
                  for j in passed if j.candidate.layout == layouts[0]) == [
        ("dots", 2, "a faster rung of its layout fits"),
        ("dots", 4, "a rung of its layout with no more recompute fits"),
        ("full", 2, "a rung of its layout with no more recompute fits"),
        ("full", 4, "a rung of its layout with no more recompute fits")]


def test_the_overlay_loads_over_the_config_and_trains_two_steps(roomy, tmp_path):
    from nestor.orchestrator.loop.train import train

    config, plan = roomy
    path = tmp_path / "plan.yaml"
    pins = pinned_keys(list(FOUR_LAYOUTS))
    write_overlay(path, plan.ranked[0], config, pins, "nestor plan (test)")
    winner = plan.ranked[0].candidate.as_dict()
    assert overlay(plan.ranked[0], config, pins)["model"]["remat"] == "full"
    loaded = load(None, [*TINY, "cluster.launcher=inprocess", "run.compile_cache=null", f"run.dir={tmp_path / 'run'}",
                         "train.steps=2", str(path)])
    assert loaded.mesh.ici_shape() == {axis: winner[f"mesh.{axis}"] for axis in MESH_AXES}
    assert loaded.mesh.dcn_shape() == {axis: winner[f"mesh.dcn.{axis}"] for axis in MESH_AXES}
    result = train(loaded, devices=jax.devices()[:8], console=Console(log=lambda line: None))
    assert len(result.losses) == 2 and all(math.isfinite(loss) for loss in result.losses)


def test_measuring_trains_the_top_candidates_and_ranks_them_by_measured_step(roomy, tmp_path, monkeypatch):
    config, plan = roomy
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the runs' directories are made
    measured = measure(config, plan.ranked[:2], steps=3)
    assert [m.error for m in measured] == [None, None]
    assert {id(m.judged) for m in measured} == {id(j) for j in plan.ranked[:2]}
    steps = [m.step_s for m in measured]
    assert steps == sorted(steps) and all(0 < step < 60 for step in steps)
    assert list(tmp_path.iterdir()) == []  # every run's directory is removed
    text = format_measured(config, measured, 3)
    for index, m in enumerate(measured, 1):  # measured and predicted side by side
        line = next(line for line in text.splitlines() if line.startswith(f"{index} "))
        assert f"{m.step_s * 1e3:.1f}" in line and f"{m.judged.predicted['step_s'] * 1e3:.1f}" in line


def test_a_candidate_that_fails_to_run_is_reported_with_its_first_error_line(roomy, tmp_path):
    config, plan = roomy
    missing = config.replace(**{"data.source": "text", "data.paths": [str(tmp_path / "nowhere" / "*.txt")]})
    (failed,) = measure(missing, plan.ranked[:1], steps=2)  # the plan compiled without data; a run reads it
    assert failed.step_s is None and failed.error.startswith("ConfigError: data.paths") and "\n" not in failed.error
    assert f"failed: {label(failed.judged.candidate)}: {failed.error}" in format_measured(missing, [failed], 2)


def test_nestor_plan_measure_prints_both_steps_and_writes_the_measured_winner(capsys, tmp_path, monkeypatch):
    from nestor.orchestrator.commands.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temporary"))
    (tmp_path / "temporary").mkdir()
    out_file = tmp_path / "plan.yaml"
    code = main(["plan", str(ROOT / "configs" / "quickstart.yaml"), "cluster.launcher=inprocess", "cluster.hosts=1",
                 "cluster.devices_per_host=8", "run.compile_cache=null", *FOUR_LAYOUTS, "moe.num_experts=0",
                 "moe.every=0", "data.source=synthetic", "--measure", "2", "--steps", "3", "--out", str(out_file)])
    captured = capsys.readouterr()
    assert code == 0 and captured.err.count("measuring [") == 2  # a progress line per candidate
    table = captured.out.split("measured: 2 candidates x 3 steps", 1)[1].splitlines()
    first = table[2].split()  # 1, settings..., measured ms, predicted ms, ratio, tokens/s, predicted #
    assert table[1].split()[:4] == ["#", "settings", "measured", "ms"] and first[0] == "1"
    assert float(first[-5]) / float(first[-4]) == pytest.approx(float(first[-3]), abs=0.01)
    assert "wrote the measured winner to" in captured.out
    head = out_file.read_text().splitlines()[1]
    assert f"measured {first[-5]} ms" in head
    written = load(str(ROOT / "configs" / "quickstart.yaml"), [str(out_file)])
    assert written.cluster.launcher == "inprocess" and written.model.remat == "full"  # the pins kept
    assert " ".join(first[1:-5]) == head.split("(", 1)[1].split(")")[0]  # the measured winner's settings
    assert list((tmp_path / "temporary").iterdir()) == []


def test_measuring_is_refused_before_the_search_on_a_cluster_by_address_and_for_too_few_steps(capsys):
    from nestor.orchestrator.commands.cli import main

    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    assert main(["plan", quickstart, "cluster.address=10.0.0.5:6379", "--measure", "2"]) == 2
    err = capsys.readouterr().err
    assert "planning" not in err  # refused before the search
    assert "cluster.address: 10.0.0.5:6379: --measure trains each candidate into a temporary run.dir" in err
    assert main(["plan", quickstart, "cluster.launcher=inprocess", "--measure", "2", "--steps", "1"]) == 2
    assert "--steps: 1: the first 1 step is not timed" in capsys.readouterr().err
    assert main(["plan", quickstart, "--steps", "5"]) == 2
    assert "add --measure K" in capsys.readouterr().err


def test_the_hlo_device_groups_are_read_in_listed_iota_and_mesh_forms():
    assert _groups("replica_groups={{0,1},{2,3}}, to_apply=%add") == ((0, 1), (2, 3))
    assert _groups("replica_groups=[2,4]<=[8], to_apply=%add") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert _groups("replica_groups=[4,2]<=[2,4]T(1,0), x") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert _groups("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, x") == (
        (0, 4), (1, 5), (2, 6), (3, 7))
    assert _groups("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, x") == (
        (0, 1), (2, 3), (4, 5), (6, 7))
    assert _groups("source_target_pairs={{0,4},{4,0}}, x") == ((0, 4), (4, 0))


RAGGED_HLO = """HloModule exchange, entry_computation_layout={(bf16[128,64]{1,0})->bf16[128,64]{1,0}}

ENTRY %main (rows: bf16[128,64]) -> bf16[128,64] {
  %rows = bf16[128,64]{1,0} parameter(0)
  %buffer = bf16[512,64]{1,0} broadcast(bf16[] constant(0)), dimensions={}
  %sizes = s64[4]{0} constant({32, 32, 32, 32})
  %out = ((bf16[128,64]{1,0}, bf16[512,64]{1,0}, s64[4]{0}, s64[4]{0}, s64[4]{0}, s64[4]{0}), bf16[512,64]{1,0}) ragged-all-to-all-start(%rows, %buffer, %sizes, %sizes, %sizes, %sizes), channel_id=1, replica_groups={{0,1,2,3}}
  %received = bf16[512,64]{1,0} ragged-all-to-all-done(%out)
  %again = bf16[512,64]{1,0} ragged-all-to-all(%rows, %buffer, %sizes, %sizes, %sizes, %sizes), channel_id=2, replica_groups={{0,1,2,3}}
  ROOT %gathered = bf16[512,64]{1,0} all-gather(%rows), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
}
"""


def test_a_ragged_all_to_all_is_costed_by_the_rows_it_sends_not_its_worst_case_buffer():
    ops = collective_ops(RAGGED_HLO)
    # 128 rows sent into a buffer of 512 (room for every row from one device): asynchronous, then synchronous
    assert [(op.kind, op.bytes) for op in ops] == [("all-to-all", 128 * 64 * 2), ("all-to-all", 128 * 64 * 2),
                                                   ("all-gather", 512 * 64 * 2)]


def test_collective_bytes_follow_the_ring_and_the_links_a_group_crosses():
    reduce = CollectiveOp("all-reduce", 800, 1, ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert sent_bytes(reduce, 4) == 2 * 3 / 4 * 800
    assert sent_bytes(CollectiveOp("reduce-scatter", 200, 1, ()), 4) == 600
    assert sent_bytes(CollectiveOp("all-gather", 800, 1, ()), 4) == 600
    hosts = [0, 0, 0, 0, 1, 1, 1, 1]
    assert not crosses_hosts(reduce, hosts)
    assert crosses_hosts(CollectiveOp("all-reduce", 800, 1, ((0, 4), (1, 5))), hosts)
    assert crosses_hosts(CollectiveOp("all-reduce", 800, 1, ()), hosts)  # no groups: every device
    h100 = device_for("h100", "bfloat16")
    assert h100.achieved_tflops == pytest.approx(989 * calibration()["efficiency_h100"]["value"])
    assert h100.within_host_gbps > h100.across_hosts_gbps and h100.step_latency_s == 0  # none measured


def test_each_ring_step_of_a_collective_pays_the_links_latency_whatever_its_bytes():
    cpu = device_for(None, "float32")
    assert cpu.step_latency_s == pytest.approx(calibration()["cpu_collective_step_us"]["value"] * 1e-6)
    assert [ring_steps(CollectiveOp(kind, 4, 1, ()), 8) for kind in
            ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")] == [14, 7, 7, 7, 1]
    hosts = [0] * 8
    tiny_over_8 = CollectiveOp("all-reduce", 4, 3, ())  # 3 runs of 4 bytes over all 8 devices
    tiny_over_2 = CollectiveOp("all-reduce", 4, 3, ((0, 1), (2, 3), (4, 5), (6, 7)))
    seconds = communication_s([tiny_over_8], hosts, cpu)["within_host"]
    assert seconds == pytest.approx(3 * (14 * cpu.step_latency_s + 2 * 7 / 8 * 4 / (cpu.within_host_gbps * 1e9)))
    # the latency, not the bytes, sets a small collective's cost: 8 devices' ring is 7x 2 devices'
    assert seconds / communication_s([tiny_over_2], hosts, cpu)["within_host"] == pytest.approx(7, rel=1e-3)


def test_every_calibration_constant_states_its_provenance_and_a_missing_one_is_caught():
    constants = calibration()
    assert provenance_problems(constants) == []
    for entry in constants.values():  # the commit is one of this repository's
        found = subprocess.run(["git", "cat-file", "-e", f"{entry['commit']}^{{commit}}"], cwd=ROOT, capture_output=True)
        assert found.returncode == 0, entry
    broken = {"x": {"value": 1.0, "date": "2026-12-06", "commit": "a806ab5", "device": "cpu"},
              "y": {"value": 1.0, "date": "yesterday", "commit": "a806ab5", "device": "cpu", "source": "bench"},
              "z": {"date": "2026-12-06", "commit": "HEAD", "device": "cpu", "source": "bench"}}
    assert provenance_problems(broken) == ["x: no source", "y: date 'yesterday' is not YYYY-MM-DD",
                                           "z: no numeric value", "z: commit 'HEAD' is not a commit hash"]


def test_the_compile_cache_serves_a_second_search(roomy):
    config, _ = roomy
    assert len(search_module._COMPILED) >= 4
    again = search(config, pinned_keys(list(FOUR_LAYOUTS)), budget_s=600, memory_limit_gib=1.0)
    assert again.count(RANKED) == 4 and again.compiles == 0
