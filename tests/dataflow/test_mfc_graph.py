from __future__ import annotations

import pytest

from rlplex.dataflow import GraphError, MFCDef, ModelInterfaceType, build_graph, grpo_graph, ppo_graph

GEN, INF, TRAIN = ModelInterfaceType.GENERATE, ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP


def test_ppo_graph_order_dependencies_and_finals() -> None:
    graph = ppo_graph()
    names = [m.name for m in graph.mfcs]
    assert names.index("actor_gen") < names.index("ref_inf") < names.index("actor_train")
    assert set(graph.parents["actor_train"]) == {"actor_gen", "ref_inf", "rew_inf"}
    assert graph.parents["actor_gen"] == ()  # fed by the dataset
    assert [m.name for m in graph.final_mfcs] == ["actor_train"]
    assert [m.name for m in grpo_graph().final_mfcs] == ["actor_train"]


def test_unknown_key_names_mfc_and_key() -> None:
    with pytest.raises(GraphError, match=r"MFC 'b' reads key 'nope'"):
        build_graph([MFCDef("b", "m", INF, ("nope",), ("y",))], dataset_keys=("x",))


def test_two_producers_refused() -> None:
    with pytest.raises(GraphError, match=r"key 'y' is produced by two MFCs: 'a' and 'b'"):
        build_graph([MFCDef("a", "m", GEN, ("x",), ("y",)), MFCDef("b", "m", INF, ("x",), ("y",))], ("x",))


def test_cycle_refused_with_path() -> None:
    with pytest.raises(GraphError, match="cycle"):
        build_graph([MFCDef("a", "m", INF, ("x", "z"), ("y",)), MFCDef("b", "m", INF, ("y",), ("z",))], ("x",))


def test_dataset_key_also_produced_refused() -> None:
    with pytest.raises(GraphError, match="also comes from the dataset"):
        build_graph([MFCDef("a", "m", INF, ("x",), ("x",))], ("x",))


def test_bad_batch_size() -> None:
    with pytest.raises(GraphError, match="n_seqs"):
        MFCDef("a", "m", INF, ("x",), n_seqs=0)
