"""heads/policy.py: the `"tree": "auto"` policy (pure; the engine tests run it inside vLLM)."""

import random

from treedraft.heads.policy import NONE, ArmBandit, arms_for, context, grafts, neighbours


def dynamic(n: int) -> str:
    return f"dynamic:{n},{min(6, n)},{min(8, n)}"


def test_arms_greedy_graft_lookup_sampled_draw_chains():
    greedy = arms_for(60, None, 4, sampled=False, tree_of=dynamic)
    assert greedy == [NONE, "chain:1", "chain:1+lookup:4", "chain:2", "chain:2+lookup:4",
                      "chain:3", "chain:3+lookup:4", "chain:4", "chain:4+lookup:4",
                      "dynamic:8,6,8+lookup:4", "dynamic:16,6,8+lookup:4",
                      "dynamic:32,6,8+lookup:4", "dynamic:60,6,8+lookup:4"]
    sampled = arms_for(60, None, 4, sampled=True, tree_of=dynamic)
    assert sampled[:5] == [NONE, "chain:1", "chain:2", "chain:3", "chain:4"]  # q chains
    assert sampled[5:] == greedy[9:]


def test_greedy_chains_graft_a_few_lookup_nodes_and_all_of_them():
    """How many lookup nodes pay depends on the text (replies that copy their prompt's code
    accept long lookup branches): from 8 lookup nodes on, each greedy chain comes plain, with a
    quarter of them and with all; its neighbours are the chains one node longer and shorter
    with the same graft, and itself with the next graft either way: a batch where chains of one
    pay and grafts do not measures 3 neighbours, never the 16-node grafts. Drafting nothing is a
    neighbour of every arm."""
    assert grafts(0) == () and grafts(4) == (4,) and grafts(16) == (4, 16)
    arms = arms_for(60, None, 16, sampled=False, tree_of=dynamic)
    assert arms[:7] == [NONE, "chain:1", "chain:1+lookup:4", "chain:1+lookup:16", "chain:2",
                        "chain:2+lookup:4", "chain:2+lookup:16"]
    assert arms[-1] == "dynamic:60,6,8+lookup:16"
    near = {a: {arms[j] for j in js} for a, js in zip(arms, neighbours(arms), strict=True)}
    assert near["chain:2+lookup:4"] == {"chain:1+lookup:4", "chain:3+lookup:4", "chain:2",
                                        "chain:2+lookup:16", NONE}
    assert near["chain:1"] == {NONE, "chain:2", "chain:1+lookup:4"}
    assert near[NONE] == {"chain:1", "chain:1+lookup:4", "chain:1+lookup:16"}
    assert near["dynamic:8,6,8+lookup:16"] == {"chain:4", "chain:4+lookup:4", "chain:4+lookup:16",
                                               "dynamic:16,6,8+lookup:16", NONE}
    rate = {NONE: 20.0, "chain:1": 24.0, "chain:2": 27.0, "chain:3": 28.0, "chain:4": 26.0}
    b = ArmBandit({False: arms, True: [NONE]})
    # a code reply: every graft of 16 nodes beats the plain chain by half, 4 nodes by a fifth
    played = run(b, lambda a, t: rate.get(a.split("+")[0], 0) * (
        1.5 if a.endswith("+lookup:16") else 1.2 if "+" in a else 1.0), 3000, noise=0.1)
    assert b.best(context(1, 0)) == "chain:3+lookup:16"
    assert played["chain:3+lookup:16"] > 0.6 * 3000, played


def test_arms_respect_the_heads_depth_and_size():
    # a 2-head Medusa: chains at most 2 deep; a chain spec: no trees; 16 nodes: no 32
    assert arms_for(32, 2, 0, False, lambda n: f"static:{n}") == [
        NONE, "chain:1", "chain:2", "static:8", "static:16", "static:32"]
    assert arms_for(5, None, 0, False, None) == [NONE, "chain:1", "chain:2", "chain:3",
                                                   "chain:4"]
    assert arms_for(16, None, 0, False, dynamic)[-1] == "dynamic:16,6,8"
    assert arms_for(3, None, 0, False, None) == [NONE, "chain:1", "chain:2", "chain:3"]


def test_context_buckets_batch_and_sampling_majority():
    assert [context(b, 0)[0] for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16,
                                                                        16, 32]
    assert context(4, 3) == (4, True) and context(4, 2) == (4, False)


def run(bandit, rate, steps, batch=1, noise=0.3, seed=0):
    """Play `steps` steps; `rate(arm, t)` is the arm's true tokens/s; returns steps per arm."""
    rng = random.Random(seed)
    played = {}
    for t in range(steps):
        arm = bandit.plan(batch)
        played[arm] = played.get(arm, 0) + 1
        seconds = 0.05
        bandit.observe(rate(arm, t) * seconds * rng.uniform(1 - noise, 1 + noise), seconds)
    return played


def test_the_best_arm_runs_most_steps_and_exploration_stays_near_it():
    arms = [NONE, "chain:1", "chain:2", "chain:3", "chain:4"]
    true = dict(zip(arms, (20.0, 26.0, 30.0, 33.0, 28.0), strict=True))
    b = ArmBandit({False: arms, True: [NONE]})
    played = run(b, lambda a, t: true[a], 4000)
    assert max(played, key=played.get) == "chain:3"
    assert played["chain:3"] > 0.75 * 4000
    assert played[NONE] < 0.04 * 4000  # the worst arm: rarely explored once measured
    assert b.best(context(1, 0)) == "chain:3"
    realized = sum(true[a] * n for a, n in played.items()) / 4000
    assert realized > 0.95 * true["chain:3"]  # exploration costs under 5 %


def test_a_step_counts_only_when_the_step_before_ran_the_same_arm():
    """The first step of a window verifies the previous arm's drafts: it is not measured; nor
    is a step the caller marks unusable (a prefill), nor one after a step that ran no arm."""
    b = ArmBandit({False: ["a", "b"], True: ["a"]}, window=5)
    for _ in range(4):
        assert b.plan(1) == "a"
        b.observe(10, 1.0)
    assert b.stats[(1, False)][0].steps == 3  # 4 steps of "a", the first not measured
    b.plan(1)
    b.idle()  # a step that planned "a" but drafted nothing (e.g. no request could draft)
    assert b.plan(1) == "b"  # a new window: unseen arms first
    b.observe(100, 1.0)  # verifies a's drafts: not b's
    b.plan(1)
    b.observe(100, 1.0, usable=False)  # a prefill step
    b.plan(1)
    b.observe(7, 1.0)  # after the prefill step, which ran b too: measured
    assert b.rates((1, False))["b"] == 7.0
    b.plan(1)
    b.idle()
    b.plan(1)
    b.observe(50, 1.0)  # after a step that ran no arm: not measured
    assert b.rates((1, False))["b"] == 7.0


def test_only_the_best_arms_neighbours_are_measured_and_explored():
    """Rates along the size order rise to one best arm and fall after it: arms beyond the best
    arm's neighbours are never played (here drafting nothing wins, so neither trees nor chains
    of 2 run), and the neighbour runs only the exploration windows it can win."""
    arms = [NONE, "chain:1", "chain:2", "tree:8", "tree:16", "tree:32"]
    true = dict(zip(arms, (30.0, 24.0, 20.0, 15.0, 10.0, 6.0), strict=True))
    b = ArmBandit({False: arms, True: [NONE]})
    played = run(b, lambda a, t: true[a], 3000, noise=0.1)
    assert set(played) == {NONE, "chain:1"}, played
    assert played[NONE] > 0.85 * 3000  # chain:1: its two windows, then exploration


def test_grafted_and_plain_chains_are_both_neighbours():
    """Where plain and grafted chains alternate in the size order (greedy requests with lookup
    nodes), an arm's neighbours are the next chain either way, grafted or not: the walk from
    drafting nothing reaches `chain:3` though every grafted chain loses to its plain one."""
    arms = arms_for(8, None, 4, sampled=False, tree_of=lambda n: f"static:{n}")
    near = neighbours(arms)
    assert [arms[j] for j in near[arms.index("chain:2")]] == [NONE, "chain:1", "chain:2+lookup:4",
                                                              "chain:3"]
    assert neighbours(arms_for(8, None, 4, True, None)) == [[1], [0, 2], [0, 1, 3], [0, 2, 4],
                                                            [0, 3]]
    rate = {NONE: 20.0, "chain:1": 24.0, "chain:2": 28.0, "chain:3": 32.0, "chain:4": 30.0}
    b = ArmBandit({False: arms, True: [NONE]})
    played = run(b, lambda a, t: rate.get(a, rate.get(a.split("+")[0], 0) * 0.7), 2000,
                 noise=0.1)
    assert b.best(context(1, 0)) == "chain:3"
    assert played["chain:3"] > 0.8 * 2000, played
    assert "static:8+lookup:4" not in played  # beyond chain:4, which loses


def test_a_new_batch_context_starts_from_the_nearest_ones_best():
    """A queue that drains from 8 requests to 4 opens a new context: it starts with the arm
    that won at batch 8, not with drafting nothing, and walks from there."""
    arms = [NONE, "chain:1", "chain:2", "chain:3", "chain:4"]
    b = ArmBandit({False: arms, True: arms})
    run(b, lambda a, t: {NONE: 20.0, "chain:1": 24.0, "chain:2": 26.0}.get(a, 18.0), 1000,
        batch=8, noise=0.05)
    assert b.best((8, False)) == "chain:2"
    assert b.plan(4) == "chain:2"  # the first window at batch 4
    assert b.plan(1, sampled=1) == NONE  # nothing measured for sampled requests yet


def test_contexts_learn_apart():
    """Batch 1 and batch 8 (and greedy vs sampled) keep their own measurements: where a chain
    pays at batch 1 and drafting nothing pays at batch 8, each runs its own best."""
    arms = [NONE, "chain:3"]
    b = ArmBandit({False: arms, True: arms})
    run(b, lambda a, t: 30.0 if a == "chain:3" else 20.0, 1000, batch=1)
    played = run(b, lambda a, t: 90.0 if a == "chain:3" else 150.0, 1000, batch=8)
    assert b.best((1, False)) == "chain:3" and b.best((8, False)) == NONE
    assert played[NONE] > 0.75 * 1000


def test_a_drifting_machine_or_text_moves_the_choice():
    """What was measured long ago decays: when the best arm changes, the policy follows."""
    arms = [NONE, "chain:1", "chain:3"]
    b = ArmBandit({False: arms, True: [NONE]})

    def rate(a, t):  # chain:3 best for 2000 steps, then chain:1
        return {NONE: 20.0, "chain:1": 25.0 if t < 2000 else 40.0,
                "chain:3": 35.0 if t < 2000 else 22.0}[a]

    played = run(b, rate, 2000)
    assert b.best((1, False)) == "chain:3" and played["chain:3"] > 1400
    later = run(b, lambda a, t: rate(a, t + 2000), 2000, seed=1)
    assert b.best((1, False)) == "chain:1" and later["chain:1"] > 1200


def test_arms_are_compared_per_request_not_by_how_full_the_batch_was():
    """A context covers batches 5-8: an arm measured while the queue ran 8 requests must not
    beat one measured at its tail with 5 for the same per-request speed (a CPU step costs about
    the same at 5 and 8 requests, so tokens/s follows the batch). Rates are per request."""
    arms = [NONE, "chain:1"]
    b = ArmBandit({False: arms, True: [NONE]}, window=4, explore_every=2)
    per_request = {NONE: 25.0, "chain:1": 20.0}  # tokens/s of each request: drafting nothing wins
    seconds = 0.05
    for t in range(400):
        batch = 5 if t % 8 < 4 else 8  # a queue that refills and drains
        arm = b.plan(batch)
        b.observe(per_request[arm] * batch * seconds, seconds, requests=batch)
    rates = b.rates((8, False))
    assert abs(rates[NONE] - 25.0) < 1e-6 and abs(rates["chain:1"] - 20.0) < 1e-6
    assert b.best((8, False)) == NONE


def test_exploration_skips_an_arm_that_cannot_beat_the_best():
    """An arm measured at half the best's rate is not replayed at every exploration window,
    only once its decayed measurement is a step or two (where a noisy window could have hidden
    a winner): a batch where drafting loses pays almost nothing for the drafting arms."""
    arms = [NONE, "chain:1"]
    b = ArmBandit({False: arms, True: [NONE]}, explore_every=2)
    played = run(b, lambda a, t: 30.0 if a == NONE else 15.0, 4000, noise=0.05)
    assert b.best((1, False)) == NONE
    assert 0 < played["chain:1"] < 0.06 * 4000, played


def test_one_unlucky_window_does_not_hide_the_best_arm():
    """What a window accepts varies with its text several-fold: a neighbour is measured in two
    windows before exploration alone decides when to play it again. Here `chain:1`'s first window
    runs at half the rate of drafting nothing (every later one above it); its second window
    makes it the best, which brings `chain:2`, the best arm, into reach within the first dozen
    windows, not after exploration has waited out the unlucky measurement (~250 steps)."""
    arms = [NONE, "chain:1", "chain:2", "chain:3"]
    true = dict(zip(arms, (20.0, 26.0, 30.0, 28.0), strict=True))
    b = ArmBandit({False: arms, True: [NONE]})
    seen = {"chain:1": 0}

    def rate(arm, t):
        if arm == "chain:1":
            seen[arm] += 1
            if seen[arm] <= 8:  # its first window: a prompt where the head's drafts miss
                return 10.0
        return true[arm]

    first = run(b, rate, 96, noise=0.0)
    assert "chain:2" in first, first
    played = run(b, rate, 400, noise=0.0)
    assert b.best(context(1, 0)) == "chain:2"
    assert played["chain:2"] > 0.7 * 400, played


def test_a_neighbour_whose_windows_were_cut_short_is_still_measured():
    """A window ends early when the batch crosses a power of two (another context): a
    neighbour whose first windows ended before any step of it counted is still unmeasured, so it
    is played again, not left at rate 0 for good."""
    arms = [NONE, "chain:1", "chain:2"]
    b = ArmBandit({False: arms, True: [NONE]}, window=4)
    for _ in range(4):  # batch 1: drafting nothing measured
        b.plan(1)
        b.observe(1, 0.05)
    for _ in range(3):  # each return to batch 1 starts a window that a batch of 2 cuts short
        b.plan(1)
        b.observe(1, 0.05)
        b.plan(2)
        b.observe(2, 0.05, requests=2)
    assert b.stats[(1, False)][1].windows >= 2 and b.stats[(1, False)][1].steps == 0
    played = run(b, lambda a, t: 40.0 if a == "chain:1" else 20.0, 400, noise=0.0)
    assert b.best((1, False)) in ("chain:1", "chain:2"), played
    assert played.get("chain:1", 0) > 100, played


def test_drafting_nothing_is_reached_from_any_arm():
    """Drafting nothing is a neighbour of every arm: a sampled batch of 8 starts at the chain
    of 3 that won at batch 16, where every chain loses to drafting nothing but rates rise along
    the chains (not the unimodal shape the walk assumes), and still runs mostly nothing."""
    arms = arms_for(8, None, 0, sampled=True)
    b = ArmBandit({False: [NONE], True: arms})
    per_step = {NONE: 1.0, "chain:1": 1.5, "chain:2": 2.0, "chain:3": 2.5, "chain:4": 2.2}
    for _ in range(400):  # batch 16: tokens per step rise to chain:3, at one cost
        arm = b.plan(16, sampled=16)
        b.observe(per_step[arm] * 16, 0.05, requests=16)
    assert b.best((16, True)) == "chain:3"
    true = {NONE: 36.0, "chain:1": 22.0, "chain:2": 24.0, "chain:3": 25.0, "chain:4": 23.0}
    played = {}
    for _ in range(1000):
        arm = b.plan(8, sampled=8)
        played[arm] = played.get(arm, 0) + 1
        b.observe(true[arm] * 8 * 0.05, 0.05, requests=8)
    assert b.best((8, True)) == NONE and played[NONE] > 0.8 * 1000, played
