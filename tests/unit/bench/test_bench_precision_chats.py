"""`bench precision`'s whole-chat rows (bench/precision_chats.py): every later turn restores
the previous decode end, float32 chats agree in every token with reuse off, and where a chat
parts the reference's margin at the first differing token is what is reported."""

from __future__ import annotations

import pytest

from bench import precision_chats as pc

pytestmark = pytest.mark.usefixtures("model_single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from baton.model.make_model import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("pc") / "m", seed=0)


def test_rows_on_a_seeded_model(model_dir):
    rows = {r["variant"]: r for r in pc.run_model(model_dir, 3, 3, 20, 6)}
    assert list(rows) == list(pc.FORMATS)
    for r in rows.values():
        assert r["chats"] == 3 and r["later_turns"] == 6
        assert r["turns_reusing_decode_end"] == 6  # every later turn restored a decode end
        assert r["identical_chats"] + len(r["partings"]) == 3
    f32 = rows["float32"]
    assert f32["identical_chats"] == 3 and f32["identical_fraction"] == 1.0
    assert f32["max_dlogprob"] < 1e-4


def test_user_turns_are_a_function_of_seed_and_chat():
    ids = list(range(1000))
    a = pc.user_turns(ids, 4, 3, 10, seed=1)
    assert a == pc.user_turns(ids, 4, 3, 10, seed=1) != pc.user_turns(ids, 4, 3, 10, seed=2)
    assert pc.user_turns(ids, 2, 3, 10, seed=1) == a[:2]
    assert all(len(t) == 10 and t == ids[t[0] : t[0] + 10] for c in a for t in c)


def _chat(tokens, tops, cached):
    return {"tokens": tokens, "cached": cached,
            "logprobs": [[(top[0], top) for top in turn] for turn in tops]}


def test_compare_reports_the_reference_margin_where_a_chat_parts():
    ref = [_chat([[5, 6], [7, 8]], [[(-0.1, -3.0), (-0.2, -2.0)], [(-0.5, -0.9), (-0.1, -4)]],
                 [0, 4]),
           _chat([[1, 2], [3, 4]], [[(-0.1, -5.0), (-0.3, -1.0)], [(-0.2, -2.0), (-1, -2)]],
                 [0, 4])]
    got = [_chat([[5, 6], [7, 9]], [[(-0.1, -3.0), (-0.25, -2.0)], [(-0.5, -0.9), (-0.1, -4)]],
                 [0, 4]),
           _chat([[1, 2], [3, 4]], [[(-0.1, -5.0), (-0.3, -1.0)], [(-0.2, -2.0), (-1, -2)]],
                 [0, 0])]
    r = pc.compare(ref, got)
    assert r["identical_chats"] == 1 and r["identical_fraction"] == 0.5
    assert r["partings"] == [{"turn": 1, "index": 1, "margin": pytest.approx(3.9)}]
    assert r["turns_reusing_decode_end"] == 1 and r["later_turns"] == 2
    assert r["max_dlogprob"] == pytest.approx(0.05)
    assert r["min_margin_agreeing"] == pytest.approx(0.4)  # ref turn 1, index 0: -0.5 - -0.9
