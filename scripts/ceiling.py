"""How much of the reachable acceptance a head's tree gets: expected tau along the target's own
sampled replies, for the head's tree and for the best tree of as many nodes (the target as its
own drafter: `treedraft.heads.ceiling`).

    python -m treedraft.scripts.ceiling --head smollm2-135m-eagle --tree dynamic:64,6,8 \\
        --prompts mtbench --stride 10 --max-new-tokens 128 --every 8 --temperature 1

For each prompt the target samples a reply (plain decoding, seed + i); at every `--every`-th
position of it the head drafts its tree and the script computes, from the target's rows, the
expected tokens per verification pass (`expected_tau`: exact, no sampling noise) of that tree
and of the oracle trees of 1, 2, 4, ... `--nodes` nodes. Positions are weighted equally (a
decoder's own passes start at the positions its previous pass reached, so its measured tau can
differ a little). No tree drafter beats the oracle of its size: where the oracle's tau is low,
the target's own entropy, not the head, bounds acceptance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def mean(xs) -> float:
    return sum(xs) / len(xs)


class Tempered:
    """An expander whose draft distribution is q^(1/S), renormalised: trees shaped for a target
    sampled at T > 0 from a head that is sharper (S > 1) or flatter (S < 1) than it should be."""

    def __init__(self, session, s: float) -> None:
        self.session, self.s = session, s

    def expand(self, tree, nodes):
        return torch.log_softmax(self.session.expand(tree, nodes).float() / self.s, dim=-1)


def main(argv=None) -> dict:
    from tqdm.auto import tqdm

    from treedraft.heads.ceiling import expected_tau, oracle_tree, tree_rows
    from treedraft.heads.lookup import LookupIndex, draft_hybrid
    from treedraft.heads.machine import describe
    from treedraft.heads.reference import causal, plain_generate, prefill
    from treedraft.heads.sampling import SamplingParams
    from treedraft.heads.tree import parse_tree_spec
    from treedraft.training.data import first_turn, load_prompts
    from treedraft.training.target import (
        HFTarget,
        encode_chat,
        load_head_for,
        load_target,
        target_signature,
    )

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--head", default="smollm2-135m-eagle", help="head folder or shipped name")
    p.add_argument("--tree", default=None, help="the head's tree (default: its default_tree)")
    p.add_argument("--nodes", type=int, default=64, help="largest oracle tree")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--stride", type=int, default=10)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--every", type=int, default=8, help="measure every N-th reply position")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--draft-temperature", type=float, default=1.0,
                   help="shape the head's tree from q^(1/S), renormalised (1: q itself)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.every < 1:
        p.error("--nodes and --every must be >= 1")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    ds = load_prompts(args.prompts, limit=args.limit, stride=args.stride)
    loaded = load_target(args.target, dtype=getattr(torch, args.dtype))
    head = load_head_for(args.head, loaded.model, target_signature(loaded.model, loaded.tokenizer))
    spec_str = args.tree or head.config.default_tree
    spec = parse_tree_spec(spec_str)
    rates = head.tree_rates()
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n < args.nodes] + [args.nodes]
    target = HFTarget(loaded.model, head.config.target_layer_ids)
    eos = {loaded.tokenizer.eos_token_id}
    head_taus, oracle_taus, head_nodes = [], {n: [] for n in sizes}, []
    t0 = time.perf_counter()
    bar = tqdm(list(zip(ds["id"], ds["messages"], strict=True)), desc="ceiling")
    for i, (_, messages) in enumerate(bar):
        prompt = encode_chat(loaded.tokenizer, first_turn(messages))
        reply = plain_generate(target, prompt, args.max_new_tokens, params, eos,
                               torch.Generator().manual_seed(args.seed + i)).tokens
        _, hidden = prefill(target, prompt)
        session = head.draft_session()
        session.commit(hidden, torch.tensor(prompt[1:] + reply[:1]))
        index = LookupIndex()
        index.extend(prompt + reply[:1])
        for t in range(0, len(reply) - 1, args.every):  # root reply[t]; cache: prompt + reply[:t]
            drafter = session if args.draft_temperature == 1 else Tempered(
                session, args.draft_temperature)
            tree = draft_hybrid(reply[t], drafter, spec, index, rates).tree
            probs = tree_rows(target, tree.tokens.tolist(), tree.parents.tolist(), params)
            head_taus.append(expected_tau(tree.tokens, tree.parents, probs))
            head_nodes.append(tree.tokens.numel() - 1)
            _, reach = oracle_tree(target, reply[t], args.nodes, params)
            cum = torch.tensor(reach, dtype=torch.float64).cumsum(0)
            for m in sizes:
                oracle_taus[m].append(1.0 + float(cum[min(m, len(reach)) - 1]))
            step = reply[t: t + args.every]  # advance the target and the head over them
            m = len(step)
            start = target.length
            _, hidden = target.forward(torch.tensor(step), start + torch.arange(m), causal(m))
            nxt = reply[t + 1: t + m + 1]
            session.commit(hidden[: len(nxt)], torch.tensor(nxt))
            index.extend(nxt)
            if len(nxt) < m:
                break
        if head_taus:
            bar.set_postfix(head=f"{mean(head_taus):.3f}",
                            oracle=f"{mean(oracle_taus[args.nodes]):.3f}")
    if not head_taus:
        raise SystemExit("ceiling: no position measured (every reply was shorter than 2 tokens); "
                         "raise --max-new-tokens or use other prompts")
    report = {
        "head": args.head, "tree": spec_str, "draft_temperature": args.draft_temperature,
        "mean_tree_size": mean(head_nodes),
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "positions": len(head_taus), "prompts": len(ds["id"]),
        "head_expected_tau": mean(head_taus),
        "oracle_expected_tau": {str(n): mean(v) for n, v in oracle_taus.items()},
        "machine": describe(), "dtype": args.dtype, "seconds": time.perf_counter() - t0,
        "command": "python -m treedraft.scripts.ceiling " + " ".join(sys.argv[1:] if argv is None
                                                                    else argv),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
