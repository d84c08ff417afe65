"""walk_greedy and walk_sample (CPU) against ddtree_ext.reference, plus the sampling law and bad input."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    inverse_cdf_probes,
    large_logit_rows,
    poison,
    random_trees,
    root_draws,
    tied_rows,
    warped_probs,
)
from ddtree_ext import ops
from ddtree_ext import reference as ref
from ddtree_ext._loader import load_ops
from ddtree_ext.ops import Tree, Walk


def child_biased_targets(tree: Tree, vocab: int, gen: torch.Generator, follow: float = 0.8) -> torch.Tensor:
    """Target tokens [B, N]: with probability ``follow`` the token of a random child (so long paths
    happen), else a random token (usually ending the walk there)."""
    batch, n = tree.token.shape
    target = torch.randint(0, vocab, (batch, n), generator=gen)
    for b in range(batch):
        for i in range(n):
            kids = ref.children(tree, b, i)
            if kids and float(torch.rand((), generator=gen)) < follow:
                target[b, i] = tree.token[b, kids[int(torch.randint(0, len(kids), (), generator=gen))]]
    return target


def child_biased_logits(
    tree: Tree, vocab: int, gen: torch.Generator, dtype=torch.float32, boost: float = 6.0
) -> torch.Tensor:
    """Random logits [B, N, V] with a random child's token raised by ``boost`` at most nodes, so sampled
    walks go deep."""
    batch, n = tree.token.shape
    logits = torch.randn(batch, n, vocab, generator=gen) * 1.5
    favourite = child_biased_targets(tree, vocab, gen)
    logits.scatter_add_(2, favourite.unsqueeze(-1), torch.full((batch, n, 1), boost))
    return logits.to(dtype)


def poisoned_walk(batch: int, max_accept: int) -> Walk:
    walk = ops.empty_walk(batch, max_accept)
    for t in walk:
        poison(t)
    return walk


def assert_walk_equal(actual: Walk, expected: Walk) -> None:
    for name, a, e in zip(Walk._fields, actual, expected):
        assert torch.equal(a, e), f"{name}:\n{a}\n!=\n{e}"


def greedy_vs_reference(tree: Tree, target: torch.Tensor, max_accept: int) -> Walk:
    out = ops.walk_greedy(tree, target, max_accept, out=poisoned_walk(tree.token.shape[0], max_accept))
    assert_walk_equal(out, ref.walk_greedy(tree, target, max_accept))
    return out


# ---- greedy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("n", [1, 2, 9, 65])
def test_greedy_random_trees(shape, n):
    gen = torch.Generator().manual_seed(n * 31 + len(shape))
    batch = 200 if shape == "random" else 20
    tree = random_trees(batch, n, vocab=4, gen=gen, shape=shape)
    target = child_biased_targets(tree, 4, gen)
    for max_accept in (1, 3, 17):
        greedy_vs_reference(tree, target, max_accept)


def test_greedy_paths_are_long_and_cut_at_max_accept():
    """The biased targets must exercise long walks, and a walk stopping at max_accept must report the
    target's token at its last node even though a child matches it."""
    gen = torch.Generator().manual_seed(5)
    tree = random_trees(64, 65, vocab=3, gen=gen, shape="chain")
    target = child_biased_targets(tree, 3, gen, follow=1.0)
    out = greedy_vs_reference(tree, target, 6)
    assert (out.accept_len == 6).all()
    assert torch.equal(out.next_token, target.gather(1, out.accepted[:, -1:].long()).squeeze(1))


def test_greedy_first_matching_child_wins():
    # Root has children 1, 2, 3 with tokens 7, 8, 8: target 8 must go to node 2, not node 3.
    parent = torch.tensor([[-1, 0, 0, 0, 2, 3]], dtype=torch.int32)
    token = torch.tensor([[5, 7, 8, 8, 1, 2]])
    tree = ref.tree_from_parents(parent, token, torch.zeros(1, dtype=torch.int64))
    target = torch.tensor([[8, 0, 1, 2, 9, 9]])
    out = greedy_vs_reference(tree, target, 4)
    assert out.accepted.tolist() == [[0, 2, 4, -1]] and out.next_token.item() == 9


@pytest.mark.parametrize("spine", [True, False])
@pytest.mark.parametrize("budget,depths,k", [(1, 3, 2), (16, 4, 3), (64, 15, 8), (40, 3, 1)])
def test_greedy_built_trees(spine, budget, depths, k):
    """Trees from reference.build_tree, padding nodes included (K = 1 runs out of prefixes)."""
    gen = torch.Generator().manual_seed(budget + depths + k)
    batch, vocab = 8, 50
    logp = torch.log_softmax(torch.randn(batch, depths, k, generator=gen), -1).sort(-1, descending=True).values
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(batch * depths)])
    tokens = tokens.view(batch, depths, k)
    root = torch.randint(0, vocab, (batch,), generator=gen)
    tree = ref.build_tree(logp, tokens, root, torch.zeros(batch, dtype=torch.int64), budget, spine=spine)
    target = child_biased_targets(tree, vocab, gen)
    for max_accept in (2, depths + 1):
        greedy_vs_reference(tree, target, max_accept)


# ---- sampling --------------------------------------------------------------------------------

FILTERS = [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.9), (0, 0.3), (3, 0.8), (1000, 0.95)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,top_p", FILTERS)
def test_sample_vs_reference(dtype, top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 7 + int(top_p * 100))
    batch, n, vocab, max_accept = 6, 17, 40, 6
    tree = random_trees(batch, n, vocab, gen)
    logits = child_biased_logits(tree, vocab, gen, dtype)
    for temperature in (0.6, 1.0, 1.7):
        uniform = torch.rand(batch, max_accept, generator=gen)
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        out = ops.walk_sample(tree, logits, uniform, **kw, out=poisoned_walk(batch, max_accept))
        assert_walk_equal(out, ref.walk_sample(tree, logits, uniform, **kw))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.6), (6, 0.7)])
def test_sample_ties_vs_reference(top_k, top_p):
    """Integer logits make many ties at the top_k cut and in the top_p order."""
    gen = torch.Generator().manual_seed(11 + top_k)
    batch, n, vocab, max_accept = 8, 9, 12, 4
    tree = random_trees(batch, n, vocab, gen)
    logits = torch.randint(0, 3, (batch, n, vocab), generator=gen).float()
    uniform = torch.rand(batch, max_accept, generator=gen)
    kw = dict(temperature=1.0, top_k=top_k, top_p=top_p)
    out = ops.walk_sample(tree, logits, uniform, **kw, out=poisoned_walk(batch, max_accept))
    assert_walk_equal(out, ref.walk_sample(tree, logits, uniform, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (8, 1.0), (20, 1.0), (0, 0.5), (0, 0.9), (8, 0.6), (20, 0.93)])
def test_sample_keeps_what_hf_warpers_keep(dtype, top_k, top_p):
    """Where logits tie at the top_k or the top_p cut, the kept set and weights are those of HF's own warpers:
    every token tied with the k-th stays; a group tied at top_p's cut stays whole (HF's keeps an arbitrary part of
    it). Probed by inverse-CDF uniforms over the whole range, for the op and the reference."""
    gen = torch.Generator().manual_seed(top_k * 10 + int(top_p * 100))
    for vocab in (40, 3000):
        rows = tied_rows(vocab, gen).to(dtype)
        for temperature in (1.0, 0.7):
            kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
            for row, probs in zip(rows, warped_probs(rows, **kw)):
                uniform, want = inverse_cdf_probes(probs)
                assert torch.equal(root_draws(row, uniform, **kw), want)
                if vocab == 40:  # the reference, on every 16th probe (it draws one token a call)
                    assert [ref.sample_token(row, float(x), **kw) for x in uniform[::16]] == want[::16].tolist()


def test_sample_large_vocab_strided_logits_vs_reference():
    """A long vocabulary (the top_p sort grows past its first chunk) and logits as a view with padded rows."""
    gen = torch.Generator().manual_seed(3)
    batch, n, vocab, max_accept = 2, 5, 5000, 3
    tree = random_trees(batch, n, vocab, gen, shape="chain")
    logits = torch.empty(batch, n, vocab + 3)[..., :vocab].copy_(child_biased_logits(tree, vocab, gen, boost=12.0))
    uniform = torch.rand(batch, max_accept, generator=gen)
    for top_k, top_p in [(0, 1.0), (0, 0.95), (300, 0.9), (40, 1.0)]:
        kw = dict(temperature=0.9, top_k=top_k, top_p=top_p)
        out = ops.walk_sample(tree, logits, uniform, **kw, out=poisoned_walk(batch, max_accept))
        assert_walk_equal(out, ref.walk_sample(tree, logits, uniform, **kw))


# min_p after top_k and top_p (HF's order), alone and with each; 1.0 keeps only the max's tie group.
MIN_P_FILTERS = [(0, 1.0, 0.05), (0, 1.0, 0.3), (0, 1.0, 1.0), (5, 1.0, 0.2), (0, 0.9, 0.1), (3, 0.8, 0.5),
                 (1000, 0.95, 0.02)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,top_p,min_p", MIN_P_FILTERS)
def test_sample_min_p_vs_reference(dtype, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(top_k * 7 + int(top_p * 100) + int(min_p * 1000))
    batch, n, vocab, max_accept = 6, 17, 40, 6
    tree = random_trees(batch, n, vocab, gen)
    logits = child_biased_logits(tree, vocab, gen, dtype)
    for temperature in (0.6, 1.0, 1.7):
        uniform = torch.rand(batch, max_accept, generator=gen)
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        out = ops.walk_sample(tree, logits, uniform, **kw, out=poisoned_walk(batch, max_accept))
        assert_walk_equal(out, ref.walk_sample(tree, logits, uniform, **kw))


@pytest.mark.parametrize("top_k,top_p,min_p", MIN_P_FILTERS)
def test_sample_min_p_keeps_what_hf_warpers_keep(top_k, top_p, min_p):
    """The kept set and weights of HF's warpers with MinPLogitsWarper last, ties included, probed by inverse-CDF
    uniforms over the whole range, for the op and the reference."""
    gen = torch.Generator().manual_seed(top_k * 10 + int(top_p * 100) + int(min_p * 1000))
    for vocab in (40, 3000):
        rows = tied_rows(vocab, gen)
        for temperature in (1.0, 0.7):
            kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            for row, probs in zip(rows, warped_probs(rows, **kw)):
                uniform, want = inverse_cdf_probes(probs)
                assert torch.equal(root_draws(row, uniform, **kw), want)
                if vocab == 40:
                    assert [ref.sample_token(row, float(x), **kw) for x in uniform[::16]] == want[::16].tolist()


@pytest.mark.parametrize("min_p", [0.1, 0.05, 0.3])
def test_sample_min_p_near_its_cut_at_large_logits_keeps_what_hf_keeps(min_p):
    """HF's min-p warper compares probabilities, i.e. exp(x - max x) with min_p: x - max x is exact near the top,
    so the op's cut is on it (x - max x >= log(min_p) in float32), not on max x + log(min_p), which rounds to a
    different step here."""
    gen = torch.Generator().manual_seed(int(min_p * 100))
    rows = large_logit_rows(3000, gen)
    kw = dict(temperature=1.0, min_p=min_p)
    for row, probs in zip(rows, warped_probs(rows, **kw)):
        uniform, want = inverse_cdf_probes(probs)
        assert torch.equal(root_draws(row, uniform, **kw), want)
        assert [ref.sample_token(row, float(x), **kw) for x in uniform[::64]] == want[::64].tolist()


def test_sample_reproducible():
    gen = torch.Generator().manual_seed(8)
    tree = random_trees(4, 33, 16, gen)
    logits = child_biased_logits(tree, 16, gen)
    uniform = torch.rand(4, 8, generator=gen)
    kw = dict(temperature=0.8, top_k=6, top_p=0.9)
    first = ops.walk_sample(tree, logits, uniform, **kw)
    assert_walk_equal(ops.walk_sample(tree, logits, uniform, **kw, out=poisoned_walk(4, 8)), first)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p",
                         [(1.0, 0, 1.0, 0.0), (0.7, 3, 1.0, 0.0), (1.3, 0, 0.85, 0.0), (1.0, 4, 0.8, 0.0),
                          (1.0, 0, 1.0, 0.25), (1.2, 4, 0.9, 0.15)])
def test_sample_law(temperature, top_k, top_p, min_p):
    """Lossless sampling: over many draws the committed (first, second) tokens follow the target's
    p(t1) p(t2 | t1). Tree of depth 2 holding every token at every node, so every draw is followed."""
    vocab, draws = 5, 20000
    parent = [-1] + [0] * vocab + [1 + i // vocab for i in range(vocab * vocab)]
    token = [vocab] + list(range(vocab)) + list(range(vocab)) * vocab
    n = len(parent)
    one = ref.tree_from_parents(
        torch.tensor([parent], dtype=torch.int32), torch.tensor([token]), torch.zeros(1, dtype=torch.int64)
    )
    tree = Tree(*(t.expand(draws, *t.shape[1:]).contiguous() for t in one))
    gen = torch.Generator().manual_seed(2024)
    logits_one = torch.randn(n, vocab, generator=gen) * 1.5
    uniform = torch.rand(draws, 3, generator=gen)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    out = ops.walk_sample(tree, logits_one.expand(draws, n, vocab), uniform, **kw)
    assert (out.accept_len == 3).all()
    first, second = tree.token[0, out.accepted[:, 1].long()], tree.token[0, out.accepted[:, 2].long()]
    observed = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()

    probs = warped_probs(logits_one, temperature, top_k, top_p, min_p)  # [n, V]
    expected = (probs[0].unsqueeze(1) * probs[1 : 1 + vocab]).reshape(-1) * draws  # p(t1) p(t2 | t1)
    impossible = expected == 0
    assert observed[impossible].sum() == 0, "a filtered-out token was drawn"
    chi2 = ((observed - expected)[~impossible] ** 2 / expected[~impossible]).sum().item()
    dof = int((~impossible).sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, f"chi-square {chi2:.1f} with {dof} degrees of freedom"


# ---- bad input -------------------------------------------------------------------------------


def _small_case():
    gen = torch.Generator().manual_seed(0)
    tree = random_trees(2, 7, 3, gen)
    target = child_biased_targets(tree, 3, gen)
    logits = torch.randn(2, 7, 11, generator=gen)
    uniform = torch.rand(2, 4, generator=gen)
    return tree, target, logits, uniform


def _bad_links(kind):
    tree, target, _, _ = _small_case()
    bad = tree.first_child.clone() if kind == "first_child" else tree.next_sibling.clone()
    bad[1, 3] = 2 if kind == "first_child" else 99  # backwards (a cycle) / out of range
    return tree._replace(**{kind: bad})


GREEDY_BAD = {
    "node_token": lambda t, tg: (t._replace(token=t.token.int()), tg),
    "first_child": lambda t, tg: (_bad_links("first_child"), tg),
    "next_sibling": lambda t, tg: (_bad_links("next_sibling"), tg),
    "target_token": lambda t, tg: (t, tg[:, :-1]),
}


@pytest.mark.parametrize("arg", list(GREEDY_BAD))
def test_greedy_bad_input(arg):
    tree, target, _, _ = _small_case()
    tree, target = GREEDY_BAD[arg](tree, target)
    out = poisoned_walk(2, 4)
    with pytest.raises(ValueError, match=f"walk_greedy: {arg}"):
        ops.walk_greedy(tree, target, 4, out=out)
    assert all((t == -7777).all() for t in out), "a failed call wrote its outputs"


def test_greedy_bad_output_buffers():
    tree, target, _, _ = _small_case()
    cases = {
        "accepted": ops.Walk(torch.empty(2, 0, dtype=torch.int32), *ops.empty_walk(2, 4)[1:]),
        "accept_len": ops.empty_walk(2, 4)._replace(accept_len=torch.empty(2, dtype=torch.int64)),
        "next_token": ops.empty_walk(2, 4)._replace(next_token=torch.empty(2, 2, dtype=torch.int64)[:, 0]),
    }
    for arg, out in cases.items():
        with pytest.raises(ValueError, match=f"walk_greedy: {arg}"):
            ops.walk_greedy(tree, target, 4, out=out)


SAMPLE_BAD = {  # name: (argument named in the error, change of the keyword arguments)
    "logits_dtype": ("logits", lambda kw: kw.update(logits=kw["logits"].long())),
    "logits_last_dim_strided": ("logits", lambda kw: kw.update(logits=kw["logits"].mT.contiguous().mT)),
    "uniform_value": ("uniform", lambda kw: kw.update(uniform=kw["uniform"].clone().fill_(1.0))),
    "uniform_dtype": ("uniform", lambda kw: kw.update(uniform=kw["uniform"].double())),
    "temperature": ("temperature", lambda kw: kw.update(temperature=0.0)),
    "top_k": ("top_k", lambda kw: kw.update(top_k=-1)),
    "top_p_zero": ("top_p", lambda kw: kw.update(top_p=0.0)),
    "top_p_over_one": ("top_p", lambda kw: kw.update(top_p=1.5)),
    "min_p_negative": ("min_p", lambda kw: kw.update(min_p=-0.1)),
    "min_p_over_one": ("min_p", lambda kw: kw.update(min_p=1.5)),
    "min_p_nan": ("min_p", lambda kw: kw.update(min_p=float("nan"))),
}


@pytest.mark.parametrize("name", list(SAMPLE_BAD))
def test_sample_bad_input(name):
    tree, _, logits, uniform = _small_case()
    kw = dict(logits=logits, uniform=uniform, temperature=1.0, top_k=0, top_p=1.0)
    arg, change = SAMPLE_BAD[name]
    change(kw)
    out = poisoned_walk(2, 4)
    with pytest.raises(ValueError, match=f"walk_sample: {arg}"):
        ops.walk_sample(tree, **kw, out=out)
    assert all((t == -7777).all() for t in out), "a failed call wrote its outputs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_argmax_is_torch_argmax(dtype):
    """The CPU op and the reference are torch.argmax: the first maximum of every row, a NaN above every number (the
    first NaN), over leading dims and strided rows."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (2, 5, 300), generator=gen).to(dtype)
    x[0, 0] = -torch.inf
    x[0, 1, [40, 9]] = torch.nan
    x[1, 2, 100] = torch.inf
    want = x.float().argmax(-1)
    assert want[0, 0] == 0 and want[0, 1] == 9
    for got in (ops.row_argmax(x), ref.row_argmax(x)):
        assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(ops.row_argmax(x[:, ::2, 1:]), x[:, ::2, 1:].float().argmax(-1))
    out = torch.full((2, 5), -1, dtype=torch.int64)
    assert ops.row_argmax(x, out=out) is out and torch.equal(out, want)
    strided = torch.full((2, 10), -1, dtype=torch.int64)[:, ::2]  # an out the op cannot write in place
    assert ops.row_argmax(x, out=strided) is strided and torch.equal(strided, want)


def test_row_argmax_other_dtypes_run_torch_argmax():
    """A float64 model's logits (or integers) are not the compiled op's: ops.row_argmax runs torch.argmax for them."""
    x = torch.tensor([[1.0, 3.0, 3.0, float("nan")], [2.0, -1.0, 2.0, 0.5]], dtype=torch.float64)
    assert torch.equal(ops.row_argmax(x), torch.tensor([3, 0]))
    assert torch.equal(ops.row_argmax(x[:, :3].long()), torch.tensor([1, 0]))


ARGMAX_BAD = {  # name: (x, out, the argument the error names); the raw op's checks, and the wrapper's shape check
    "x_dtype": (torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.int64), "x"),
    "x_empty_rows": (torch.zeros(3, 0), torch.zeros(3, dtype=torch.int64), "x"),
    "x_last_dim_strided": (torch.zeros(4, 3).t(), torch.zeros(3, dtype=torch.int64), "x"),
    "out_dtype": (torch.zeros(3, 4), torch.zeros(3, dtype=torch.int32), "out"),
    "out_shape": (torch.zeros(3, 4), torch.zeros(4, dtype=torch.int64), "out"),
    "out_strided": (torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.int64)[:, 0], "out"),
}


@pytest.mark.parametrize("name", list(ARGMAX_BAD))
def test_row_argmax_bad_input(name):
    x, out, arg = ARGMAX_BAD[name]
    out.fill_(-7)
    with pytest.raises(ValueError, match=f"row_argmax: {arg}"):
        load_ops().row_argmax(x, out)
    if name == "out_shape":
        with pytest.raises(ValueError, match="row_argmax: out"):
            ops.row_argmax(x, out=out)
    assert (out == -7).all(), "a failed call wrote its output"


def test_opcheck_walks():
    tree, target, logits, uniform = _small_case()
    o = load_ops()
    torch.library.opcheck(o.row_argmax, (logits.view(-1, logits.shape[-1]), torch.empty(logits.shape[:-1].numel(), dtype=torch.int64)))
    torch.library.opcheck(
        o.walk_greedy, (tree.token, tree.first_child, tree.next_sibling, target, *ops.empty_walk(2, 4))
    )
    torch.library.opcheck(
        o.walk_sample,
        (tree.token, tree.first_child, tree.next_sibling, logits, uniform, 0.9, 3, 0.8, 0.1, *ops.empty_walk(2, 4)),
    )
