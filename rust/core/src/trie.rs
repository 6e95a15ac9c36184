//! Radix-trie merge of a rollout's calls into training samples (docs/design.md#merge).
//!
//! Every call's full sequence `S = prompt ++ completion` is inserted into a radix
//! trie whose edges are ranges of the inserted sequences (no token is copied
//! while building). Positions a call generated are recorded on the edges as
//! spans, so a later call that carries earlier output as context walks the same
//! nodes, and a turn-by-turn conversation collapses into one path.
//!
//! Children keep creation order; samples are the root-to-leaf paths in DFS order,
//! and each node's generated tokens are trained (weight = number of generating
//! calls) in the first sample that contains the node, and are context elsewhere.

use std::collections::HashMap;
use std::time::Instant;

use rayon::prelude::*;

use crate::arrays::{Arrays, Fresh};
use crate::error::CoreError;
use crate::trace::{CallView, Divergence, DivergenceKind, MergeStats, Merged, PackedTree, Sample};

/// A span `[from, to)` of depths that `call` generated on one edge.
#[derive(Debug, Clone, Copy)]
struct Gen {
    call: u32,
    from: u32,
    to: u32,
}

#[derive(Debug)]
struct Node {
    /// Call whose sequence holds this edge's tokens, at depths `start..end`.
    src: u32,
    start: u32,
    end: u32,
    /// Child node indices in creation order.
    children: Vec<u32>,
    /// Generation spans, in insertion (= call) order.
    gens: Vec<Gen>,
    /// Latest call whose path covers this edge (names the path a call leaves).
    last: u32,
    /// Some call's sequence ends exactly at `end`.
    ends: bool,
}

/// What inserting one call found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inserted {
    /// `(position, left_call)` when the call's prompt departed from an existing path.
    pub divergence: Option<(usize, usize)>,
    /// The call's full sequence equals an earlier call's.
    pub duplicate: bool,
}

/// A radix trie over calls of one rollout (or one group). Call indices are
/// indices into the `calls` slice it was created with.
#[derive(Debug)]
pub struct Trie<'c, 'a> {
    calls: &'c [CallView<'a>],
    nodes: Vec<Node>,
}

const ROOT: usize = 0;

/// Length of the common prefix of two slices. Whole-slice and chunk equality
/// compile to `memcmp`, so equal runs (the common case) are compared in bulk.
#[inline]
pub fn lcp(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    if a == b {
        return n;
    }
    const CHUNK: usize = 64;
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Total common-prefix length of each pair, read in order: the least reading
/// any prefix merge does on input laid out as one array per call (no trie, no
/// output), which `benches/merge.py` measures. While one pair is compared, the
/// first cache lines of the next are prefetched, so the floor is not inflated
/// by a memory stall at every array's start (which the hardware prefetcher
/// cannot foresee).
pub fn lcp_pairs(pairs: &[(&[u32], &[u32])]) -> usize {
    let mut n = 0;
    for (i, (x, y)) in pairs.iter().enumerate() {
        if let Some((nx, ny)) = pairs.get(i + 1) {
            prefetch_start(nx);
            prefetch_start(ny);
        }
        n += lcp(x, y);
    }
    n
}

/// Hint the first four cache lines of `x` into the cache.
#[inline]
#[allow(unsafe_code)] // the one intrinsic below; see its SAFETY note
fn prefetch_start(x: &[u32]) {
    #[cfg(target_arch = "x86_64")]
    for k in (0..x.len().min(64)).step_by(16) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint that never faults; the address is inside `x`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(x.as_ptr().add(k).cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Common prefix of two sequences given as (up to) two pieces each.
fn lcp_pieces(a: [&[u32]; 2], b: [&[u32]; 2]) -> usize {
    let (mut ai, mut bi) = (0usize, 0usize);
    let (mut x, mut y) = (a[0], b[0]);
    let mut total = 0;
    loop {
        while x.is_empty() {
            ai += 1;
            if ai == 2 {
                return total;
            }
            x = a[ai];
        }
        while y.is_empty() {
            bi += 1;
            if bi == 2 {
                return total;
            }
            y = b[bi];
        }
        let k = lcp(x, y);
        total += k;
        if k < x.len().min(y.len()) {
            return total;
        }
        x = &x[k..];
        y = &y[k..];
    }
}

impl<'c, 'a> Trie<'c, 'a> {
    pub fn new(calls: &'c [CallView<'a>]) -> Self {
        let root = Node {
            src: 0,
            start: 0,
            end: 0,
            children: Vec::new(),
            gens: Vec::new(),
            last: 0,
            ends: false,
        };
        Trie {
            calls,
            nodes: vec![root],
        }
    }

    #[inline]
    fn first_token(&self, node: usize) -> u32 {
        let n = &self.nodes[node];
        self.calls[n.src as usize].token(n.start as usize)
    }

    /// Split `node` so that it ends at depth `at`; the rest becomes its only child.
    fn split(&mut self, node: usize, at: u32) {
        let tail_idx = self.nodes.len() as u32;
        let n = &mut self.nodes[node];
        let mut head_gens = Vec::with_capacity(n.gens.len());
        let mut tail_gens = Vec::new();
        for g in n.gens.drain(..) {
            if g.to <= at {
                head_gens.push(g);
            } else if g.from >= at {
                tail_gens.push(g);
            } else {
                head_gens.push(Gen { to: at, ..g });
                tail_gens.push(Gen { from: at, ..g });
            }
        }
        let tail = Node {
            src: n.src,
            start: at,
            end: n.end,
            children: std::mem::replace(&mut n.children, vec![tail_idx]),
            gens: tail_gens,
            last: n.last,
            ends: n.ends,
        };
        n.gens = head_gens;
        n.end = at;
        n.ends = false;
        self.nodes.push(tail);
    }

    /// Call `c` covers the whole of `node`: record it.
    #[inline]
    fn cover(&mut self, node: usize, c: u32, prompt_len: u32) {
        let n = &mut self.nodes[node];
        n.last = c;
        if n.end > prompt_len {
            n.gens.push(Gen {
                call: c,
                from: n.start.max(prompt_len),
                to: n.end,
            });
        }
    }

    /// Insert call `c` (an index into `calls`). Calls must be inserted in order.
    pub fn insert(&mut self, c: usize) -> Inserted {
        let call = self.calls[c];
        let n = call.len();
        let p = call.prompt.len() as u32;
        let cu = c as u32;
        let mut node = ROOT;
        let mut d = 0usize;
        loop {
            if d == n {
                let dup = self.nodes[node].ends;
                self.nodes[node].ends = true;
                return Inserted {
                    divergence: None,
                    duplicate: dup,
                };
            }
            let t = call.token(d);
            let child = self.nodes[node]
                .children
                .iter()
                .copied()
                .find(|&ch| self.first_token(ch as usize) == t);
            let Some(ch) = child else {
                // An existing continuation at depth d that this call's prompt does
                // not follow is a departure; a path that simply ends here is not.
                let siblings = &self.nodes[node].children;
                let divergence = if (d as u32) < p && !siblings.is_empty() {
                    let left = siblings
                        .iter()
                        .map(|&s| self.nodes[s as usize].last)
                        .max()
                        .unwrap_or(0);
                    Some((d, left as usize))
                } else {
                    None
                };
                let leaf = self.nodes.len();
                self.nodes.push(Node {
                    src: cu,
                    start: d as u32,
                    end: n as u32,
                    children: Vec::new(),
                    gens: Vec::new(),
                    last: cu,
                    ends: true,
                });
                self.nodes[node].children.push(leaf as u32);
                self.cover(leaf, cu, p);
                return Inserted {
                    divergence,
                    duplicate: false,
                };
            };
            let ch = ch as usize;
            let (start, end) = (self.nodes[ch].start as usize, self.nodes[ch].end as usize);
            let stop = end.min(start + (n - d));
            let k = lcp_pieces(call.pieces(d, d + (stop - start)), self.edge_upto(ch, stop));
            if start + k < end {
                self.split(ch, (start + k) as u32);
            }
            self.cover(ch, cu, p);
            d += k;
            node = ch;
        }
    }

    #[inline]
    fn edge_upto(&self, node: usize, stop: usize) -> [&'a [u32]; 2] {
        let n = &self.nodes[node];
        self.calls[n.src as usize].pieces(n.start as usize, stop)
    }

    /// The read-only view of this trie.
    #[inline]
    pub fn as_ref(&self) -> TrieRef<'_, 'c, 'a> {
        TrieRef {
            calls: self.calls,
            nodes: &self.nodes,
        }
    }

    /// The nodes, without the borrow of the calls (see [`MergePlan`]).
    fn into_nodes(self) -> Vec<Node> {
        self.nodes
    }

    /// Number of trie nodes including the root (for tests and benchmarks).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Weight, first generator and logprob at `depth` on the path of call `c`
    /// (test helper; O(path)).
    pub fn lookup(&self, c: usize, depth: usize) -> Option<(u32, i32, f32)> {
        let call = self.calls[c];
        let mut node = ROOT;
        let mut d = 0usize;
        while d <= depth && depth < call.len() {
            let t = call.token(d);
            let ch = self.nodes[node]
                .children
                .iter()
                .copied()
                .find(|&ch| self.first_token(ch as usize) == t)? as usize;
            let n = &self.nodes[ch];
            if depth < n.end as usize {
                return Some(self.as_ref().position(n, depth as u32));
            }
            d = n.end as usize;
            node = ch;
        }
        None
    }
}

/// A trie's nodes with the calls they index, read-only: what writing samples
/// and packing need, so a plan can keep its nodes without borrowing the calls.
#[derive(Debug, Clone, Copy)]
pub struct TrieRef<'n, 'c, 'a> {
    calls: &'c [CallView<'a>],
    nodes: &'n [Node],
}

impl TrieRef<'_, '_, '_> {
    /// Weight, first generator and logprob of the token at `depth` on `node`.
    #[inline]
    fn position(&self, node: &Node, depth: u32) -> (u32, i32, f32) {
        let mut count = 0u32;
        let mut first = -1i32;
        let mut lp = f32::NAN;
        for g in &node.gens {
            if g.from <= depth && depth < g.to {
                count += 1;
                if first < 0 {
                    first = g.call as i32;
                }
                if lp.is_nan() {
                    lp = self.calls[g.call as usize].logprob_at(depth as usize);
                }
            }
        }
        (count, first, lp)
    }

    /// Root-to-leaf paths in DFS order (children in creation order), cut at
    /// `limit` tokens. A node is trained in the first sample that contains it;
    /// samples left with nothing to train after the cut are marked `keep: false`.
    fn layouts(&self, limit: usize) -> Vec<Layout> {
        let mut out = Vec::new();
        let mut visited = vec![false; self.nodes.len()];
        // (node, next child to visit)
        let mut stack: Vec<(usize, usize)> = vec![(ROOT, 0)];
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            let children = &self.nodes[node].children;
            if node != ROOT && children.is_empty() {
                let mut layout = Layout {
                    path: Vec::with_capacity(stack.len() - 1),
                    len: (self.nodes[node].end as usize).min(limit),
                    truncated: 0,
                    keep: false,
                };
                for &(n, _) in &stack[1..] {
                    let first = !visited[n];
                    visited[n] = true;
                    layout.path.push((n as u32, first));
                    if first {
                        for g in &self.nodes[n].gens {
                            let (from, to) = (g.from as usize, g.to as usize);
                            layout.truncated += to.saturating_sub(from.max(limit));
                            layout.keep |= from < limit;
                        }
                    }
                }
                out.push(layout);
                stack.pop();
            } else if *next < children.len() {
                let ch = children[*next] as usize;
                *next += 1;
                stack.push((ch, 0));
            } else {
                stack.pop();
            }
        }
        out
    }

    /// Write one sample into buffers of exactly `layout.len` tokens.
    fn write(&self, layout: &Layout, out: SampleMut<'_>) {
        let SampleMut {
            tokens,
            weights,
            logprobs,
            call_index,
        } = out;
        let limit = layout.len;
        for &(node, first_visit) in &layout.path {
            let n = &self.nodes[node as usize];
            let start = n.start as usize;
            let end = (n.end as usize).min(limit);
            if start >= end {
                break;
            }
            let mut at = start;
            for piece in self.calls[n.src as usize].pieces(start, end) {
                tokens[at..at + piece.len()].copy_from_slice(piece);
                at += piece.len();
            }
            weights[start..end].fill(0.0);
            logprobs[start..end].fill(f32::NAN);
            call_index[start..end].fill(-1);
            for g in &n.gens {
                let call = self.calls[g.call as usize];
                let (from, to) = (g.from as usize, (g.to as usize).min(limit));
                if from >= to {
                    continue;
                }
                if first_visit {
                    for w in &mut weights[from..to] {
                        *w += 1.0;
                    }
                    for ci in &mut call_index[from..to] {
                        if *ci < 0 {
                            *ci = g.call as i32;
                        }
                    }
                }
                if let Some(l) = call.logprobs {
                    let off = call.prompt.len();
                    let src = &l[from - off..to - off];
                    for (dst, &v) in logprobs[from..to].iter_mut().zip(src) {
                        if dst.is_nan() {
                            *dst = v;
                        }
                    }
                }
            }
        }
    }

    /// (tokens, generator entries) that `pack_into` appends (see [`lay_out`]).
    fn packed_size(&self, limit: usize) -> (usize, usize) {
        let (mut tokens, mut gens) = (0usize, 0usize);
        for n in self.nodes.iter().skip(1) {
            let (start, end) = (n.start as usize, (n.end as usize).min(limit));
            if start >= end {
                continue;
            }
            tokens += end - start;
            for g in &n.gens {
                let (from, to) = ((g.from as usize).max(start), (g.to as usize).min(end));
                gens += to.saturating_sub(from);
            }
        }
        (tokens, gens)
    }

    /// Write this trie as one tree into `out` (exactly `packed_size(limit)`
    /// tokens and generator entries), cut at `limit` tokens.
    fn pack_into(&self, limit: usize, out: TreeSlot<'_>) {
        let TreeSlot {
            first_token,
            first_gen,
            tokens,
            parent,
            depth,
            weights,
            logprobs,
            gen_ends,
            gen_call,
        } = out;
        // Next token and generator entry of this tree to write.
        let (mut at, mut g_at) = (0usize, 0usize);
        // (node, next child, global index of the node's last token)
        let mut stack: Vec<(usize, usize, i64)> = vec![(ROOT, 0, -1)];
        while let Some(&mut (node, ref mut next, _)) = stack.last_mut() {
            let children = &self.nodes[node].children;
            if *next >= children.len() {
                stack.pop();
                continue;
            }
            let ch = children[*next] as usize;
            *next += 1;
            let parent_last = stack.last().map_or(-1, |s| s.2);
            let n = &self.nodes[ch];
            let (start, end) = (n.start as usize, (n.end as usize).min(limit));
            if start >= end {
                continue;
            }
            let len = end - start;
            let first = (first_token + at) as i64;
            let mut k = at;
            for piece in self.calls[n.src as usize].pieces(start, end) {
                tokens[k..k + piece.len()].copy_from_slice(piece);
                k += piece.len();
            }
            parent[at] = parent_last;
            for (i, p) in parent[at + 1..at + len].iter_mut().enumerate() {
                *p = first + i as i64;
            }
            for (d, out) in (start..end).zip(&mut depth[at..at + len]) {
                *out = d as i64;
            }
            for (i, d) in (n.start..end as u32).enumerate() {
                let mut count = 0u32;
                let mut lp = f32::NAN;
                for g in &n.gens {
                    if g.from <= d && d < g.to {
                        count += 1;
                        gen_call[g_at] = g.call as i32;
                        g_at += 1;
                        if lp.is_nan() {
                            lp = self.calls[g.call as usize].logprob_at(d as usize);
                        }
                    }
                }
                weights[at + i] = count as f32;
                logprobs[at + i] = lp;
                gen_ends[at + i] = (first_gen + g_at) as i64;
            }
            at += len;
            stack.push((ch, 0, first + len as i64 - 1));
        }
        debug_assert_eq!((at, g_at), (tokens.len(), gen_call.len()));
    }
}

/// One tree's disjoint part of a [`PackedTree`]'s arrays, and where that part
/// starts in the whole forest (parents and generator offsets are global
/// indices), so the trees of a forest are written in parallel.
struct TreeSlot<'o> {
    first_token: usize,
    first_gen: usize,
    tokens: &'o mut [u32],
    parent: &'o mut [i64],
    depth: &'o mut [i64],
    weights: &'o mut [f32],
    logprobs: &'o mut [f32],
    /// The tree's part of `gen_offsets[1..]`: where each token's generators end.
    gen_ends: &'o mut [i64],
    gen_call: &'o mut [i32],
}

impl<'o> TreeSlot<'o> {
    /// The whole of `out` as one slot.
    fn all(out: &'o mut PackedTree) -> Self {
        TreeSlot {
            first_token: 0,
            first_gen: 0,
            tokens: &mut out.tokens,
            parent: &mut out.parent,
            depth: &mut out.depth,
            weights: &mut out.weights,
            logprobs: &mut out.logprobs,
            gen_ends: &mut out.gen_offsets[1..],
            gen_call: &mut out.gen_call,
        }
    }

    /// The first `tokens` tokens and `gens` generator entries, and the rest.
    fn split(self, tokens: usize, gens: usize) -> (Self, Self) {
        let (t, t_rest) = self.tokens.split_at_mut(tokens);
        let (p, p_rest) = self.parent.split_at_mut(tokens);
        let (d, d_rest) = self.depth.split_at_mut(tokens);
        let (w, w_rest) = self.weights.split_at_mut(tokens);
        let (l, l_rest) = self.logprobs.split_at_mut(tokens);
        let (e, e_rest) = self.gen_ends.split_at_mut(tokens);
        let (g, g_rest) = self.gen_call.split_at_mut(gens);
        let head = TreeSlot {
            first_token: self.first_token,
            first_gen: self.first_gen,
            tokens: t,
            parent: p,
            depth: d,
            weights: w,
            logprobs: l,
            gen_ends: e,
            gen_call: g,
        };
        let rest = TreeSlot {
            first_token: self.first_token + tokens,
            first_gen: self.first_gen + gens,
            tokens: t_rest,
            parent: p_rest,
            depth: d_rest,
            weights: w_rest,
            logprobs: l_rest,
            gen_ends: e_rest,
            gen_call: g_rest,
        };
        (head, rest)
    }
}

/// Validate `calls` and check `max_tokens`.
fn check(calls: &[CallView<'_>], max_tokens: Option<usize>) -> Result<usize, CoreError> {
    for (i, c) in calls.iter().enumerate() {
        c.validate(i)?;
    }
    match max_tokens {
        Some(0) => Err(CoreError::InvalidOption(
            "max_tokens must be at least 1 (or None for no limit)".into(),
        )),
        Some(m) => Ok(m),
        None => Ok(usize::MAX),
    }
}

/// Calls grouped by key, keys in order of first appearance, input order inside.
fn group_by<'a, K: std::hash::Hash + Eq + Copy>(
    calls: &[CallView<'a>],
    key: impl Fn(&CallView<'a>) -> K,
) -> Vec<(K, Vec<usize>)> {
    let mut index: HashMap<K, usize> = HashMap::new();
    let mut groups: Vec<(K, Vec<usize>)> = Vec::new();
    for (i, c) in calls.iter().enumerate() {
        let k = key(c);
        let g = *index.entry(k).or_insert_with(|| {
            groups.push((k, Vec::new()));
            groups.len() - 1
        });
        groups[g].1.push(i);
    }
    groups
}

/// A group as Python shows it.
fn show_group(g: Option<&str>) -> String {
    g.map_or_else(|| "None".to_string(), |g| format!("{g:?}"))
}

/// One sample's place in its trie: the path (node, trained here) and its length.
#[derive(Debug)]
struct Layout {
    path: Vec<(u32, bool)>,
    len: usize,
    truncated: usize,
    keep: bool,
}

/// Mutable output buffers for one sample (all the same length).
#[derive(Debug)]
pub struct SampleMut<'o> {
    pub tokens: &'o mut [u32],
    pub weights: &'o mut [f32],
    pub logprobs: &'o mut [f32],
    pub call_index: &'o mut [i32],
}

/// The flat output of a merge's samples: one array per field, every kept
/// sample a range of it (see [`crate::origin::CallIndex::spans`]).
#[derive(Debug, Clone, Default)]
pub struct SampleColumns {
    pub tokens: Vec<u32>,
    pub weights: Vec<f32>,
    pub logprobs: Vec<f32>,
    pub call_index: Vec<i32>,
}

impl SampleColumns {
    /// Columns of `len` tokens from `arrays`, their contents unspecified until
    /// [`MergePlan::write`] fills them (it writes every element when `len` is
    /// the plan's `stats.sample_tokens`).
    pub fn take(len: usize, arrays: &impl Arrays) -> Self {
        SampleColumns {
            tokens: arrays.take(len),
            weights: arrays.take(len),
            logprobs: arrays.take(len),
            call_index: arrays.take(len),
        }
    }

    /// The columns as one writable sample-sized window.
    pub fn as_mut(&mut self) -> SampleMut<'_> {
        SampleMut {
            tokens: &mut self.tokens,
            weights: &mut self.weights,
            logprobs: &mut self.logprobs,
            call_index: &mut self.call_index,
        }
    }
}

impl SampleMut<'_> {
    /// The first `len` positions of every buffer, and the rest.
    fn split(self, len: usize) -> (Self, Self) {
        let (t, t_rest) = self.tokens.split_at_mut(len);
        let (w, w_rest) = self.weights.split_at_mut(len);
        let (p, p_rest) = self.logprobs.split_at_mut(len);
        let (c, c_rest) = self.call_index.split_at_mut(len);
        let head = SampleMut {
            tokens: t,
            weights: w,
            logprobs: p,
            call_index: c,
        };
        let rest = SampleMut {
            tokens: t_rest,
            weights: w_rest,
            logprobs: p_rest,
            call_index: c_rest,
        };
        (head, rest)
    }
}

/// Where a planned sample goes: its rollout, group, length and what it lost.
#[derive(Debug, Clone, Copy)]
pub struct SampleInfo<'a> {
    pub rollout_id: &'a str,
    /// Input index of the rollout's first call.
    pub first_call: usize,
    pub group: Option<&'a str>,
    pub len: usize,
    pub truncated: usize,
}

#[derive(Debug)]
struct RolloutPlan {
    first_call: usize,
    nodes: Vec<Node>,
    samples: Vec<Layout>,
    /// Tokens of the kept samples.
    tokens: usize,
}

/// A merge with its tries built and its samples laid out, before any sample
/// token is written. It owns its tries (nodes index the calls it was planned
/// from, which every method takes again), so a caller can keep it and write
/// the samples only when they are asked for, sized from `stats.sample_tokens`.
#[derive(Debug)]
pub struct MergePlan {
    rollouts: Vec<RolloutPlan>,
    pub divergences: Vec<Divergence>,
    pub stats: MergeStats,
    /// Wall-clock seconds spent inserting calls and laying out samples.
    pub insert_seconds: f64,
}

impl MergePlan {
    /// The per-rollout packed tree ([`pack`] without `across_rollouts`) from the
    /// tries this plan already built, instead of inserting every call again.
    /// `calls` must be the calls planned from; the output equals `pack`'s, as the
    /// plan's rollouts are the same groups in the same order with the same
    /// insertion order. Its arrays come from `arrays`.
    pub fn pack(
        &self,
        calls: &[CallView<'_>],
        max_tokens: Option<usize>,
        arrays: &impl Arrays,
    ) -> Result<PackedTree, CoreError> {
        let limit = check(calls, max_tokens)?;
        let trees: Vec<_> = self
            .rollouts
            .iter()
            .map(|r| {
                let trie = TrieRef {
                    calls,
                    nodes: &r.nodes,
                };
                (trie, r.first_call as i32, calls[r.first_call].rollout_id)
            })
            .collect();
        Ok(lay_out(&trees, limit, arrays))
    }

    /// The kept samples, in output order. `calls` must be the calls planned from.
    pub fn samples<'p, 'a>(
        &'p self,
        calls: &'p [CallView<'a>],
    ) -> impl Iterator<Item = SampleInfo<'a>> + 'p {
        self.rollouts.iter().flat_map(move |r| {
            let first = &calls[r.first_call];
            r.samples
                .iter()
                .filter(|l| l.keep)
                .map(move |l| SampleInfo {
                    rollout_id: first.rollout_id,
                    first_call: r.first_call,
                    group: first.group,
                    len: l.len,
                    truncated: l.truncated,
                })
        })
    }

    /// Write every kept sample back to back into buffers of `stats.sample_tokens`,
    /// rollouts in parallel. `calls` must be the calls planned from.
    pub fn write(&self, calls: &[CallView<'_>], out: SampleMut<'_>) {
        // Disjoint output ranges per rollout, then one task per rollout.
        let mut parts = Vec::with_capacity(self.rollouts.len());
        let mut rest = out;
        for r in &self.rollouts {
            let (part, tail) = rest.split(r.tokens);
            parts.push((r, part));
            rest = tail;
        }
        parts.into_par_iter().for_each(|(r, mut rest)| {
            let trie = TrieRef {
                calls,
                nodes: &r.nodes,
            };
            for l in r.samples.iter().filter(|l| l.keep) {
                let (sample, tail) = rest.split(l.len);
                trie.write(l, sample);
                rest = tail;
            }
        });
    }
}

/// What planning one rollout found.
struct PlannedRollout {
    plan: RolloutPlan,
    divergences: Vec<Divergence>,
    duplicates: usize,
}

/// Insert one rollout's calls (in input order) and lay out its samples.
fn plan_rollout(
    calls: &[CallView<'_>],
    rollout_id: &str,
    members: &[usize],
    limit: usize,
) -> Result<PlannedRollout, CoreError> {
    let group = calls[members[0]].group;
    let mut trie = Trie::new(calls);
    let mut divergences = Vec::new();
    let mut duplicates = 0;
    for &c in members {
        if calls[c].group != group {
            return Err(CoreError::InvalidCall {
                index: c,
                message: format!(
                    "group {} differs from group {} of call {} in the same rollout {:?}; \
                     every call of a rollout must carry the same group",
                    show_group(calls[c].group),
                    show_group(group),
                    members[0],
                    rollout_id
                ),
            });
        }
        let ins = trie.insert(c);
        if let Some((position, left)) = ins.divergence {
            divergences.push(Divergence {
                rollout_id: rollout_id.to_string(),
                call_index: c,
                position,
                left_call_index: left,
                kind: DivergenceKind::Unclassified,
            });
        }
        duplicates += usize::from(ins.duplicate);
    }
    let samples = trie.as_ref().layouts(limit);
    let tokens = samples.iter().filter(|l| l.keep).map(|l| l.len).sum();
    Ok(PlannedRollout {
        plan: RolloutPlan {
            first_call: members[0],
            nodes: trie.into_nodes(),
            samples,
            tokens,
        },
        divergences,
        duplicates,
    })
}

/// Build one trie per rollout (grouped by rollout id, input order kept within a
/// rollout; rollouts in parallel) and lay out the samples. Call indices in the
/// output index `calls`. Divergences are reported with kind `Unclassified`.
pub fn plan(calls: &[CallView<'_>], max_tokens: Option<usize>) -> Result<MergePlan, CoreError> {
    let limit = check(calls, max_tokens)?;
    let t0 = Instant::now();
    let rollouts = group_by(calls, |c| c.rollout_id);
    let planned = rollouts
        .par_iter()
        .map(|(rollout_id, members)| plan_rollout(calls, rollout_id, members, limit))
        .collect::<Result<Vec<_>, _>>()?;
    let mut plan = MergePlan {
        rollouts: Vec::with_capacity(planned.len()),
        divergences: Vec::new(),
        stats: MergeStats::default(),
        insert_seconds: 0.0,
    };
    for p in planned {
        for l in &p.plan.samples {
            if l.keep {
                plan.stats.samples += 1;
                plan.stats.sample_tokens += l.len;
            } else {
                plan.stats.dropped_samples += 1;
            }
        }
        plan.stats.duplicates += p.duplicates;
        plan.divergences.extend(p.divergences);
        plan.rollouts.push(p.plan);
    }
    let stats = &mut plan.stats;
    stats.calls = calls.len();
    stats.rollouts = plan.rollouts.len();
    for c in calls {
        stats.generated_tokens += c.completion.len();
        stats.truncated_tokens += c.len().saturating_sub(c.prompt.len().max(limit));
    }
    plan.insert_seconds = t0.elapsed().as_secs_f64();
    Ok(plan)
}

/// Merge calls into training samples (see [`plan`]), each sample in its own vectors.
pub fn merge(calls: &[CallView<'_>], max_tokens: Option<usize>) -> Result<Merged, CoreError> {
    let plan = plan(calls, max_tokens)?;
    let t0 = Instant::now();
    let n = plan.stats.sample_tokens;
    let (mut tokens, mut weights) = (vec![0u32; n], vec![0f32; n]);
    let (mut logprobs, mut call_index) = (vec![0f32; n], vec![0i32; n]);
    plan.write(
        calls,
        SampleMut {
            tokens: &mut tokens,
            weights: &mut weights,
            logprobs: &mut logprobs,
            call_index: &mut call_index,
        },
    );
    let mut at = 0;
    let samples = plan
        .samples(calls)
        .map(|info| {
            let r = at..at + info.len;
            at += info.len;
            Sample {
                rollout_id: info.rollout_id.to_string(),
                group: info.group.map(str::to_string),
                tokens: tokens[r.clone()].to_vec(),
                weights: weights[r.clone()].to_vec(),
                logprobs: logprobs[r.clone()].to_vec(),
                call_index: call_index[r].to_vec(),
                truncated: info.truncated,
            }
        })
        .collect();
    Ok(Merged {
        samples,
        divergences: plan.divergences,
        stats: plan.stats,
        insert_seconds: plan.insert_seconds,
        samples_seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Key of the tree a call goes into when packing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum TreeKey<'a> {
    Rollout(&'a str),
    Group(&'a str),
}

/// The packed-tree form: one tree per rollout, or with `across_rollouts` one
/// tree per group (calls without a group stay in their rollout's tree), in order
/// of first appearance. Its arrays come from `arrays`.
pub fn pack(
    calls: &[CallView<'_>],
    max_tokens: Option<usize>,
    across_rollouts: bool,
    arrays: &impl Arrays,
) -> Result<PackedTree, CoreError> {
    let limit = check(calls, max_tokens)?;
    let trees = group_by(calls, |c| match (across_rollouts, c.group) {
        (true, Some(g)) => TreeKey::Group(g),
        _ => TreeKey::Rollout(c.rollout_id),
    });
    // Tries are independent: build them in parallel, then lay them out in order
    // (so the output does not depend on the thread count).
    let tries: Vec<Trie<'_, '_>> = trees
        .par_iter()
        .map(|(_, members)| {
            let mut trie = Trie::new(calls);
            for &c in members {
                trie.insert(c);
            }
            trie
        })
        .collect();
    let laid: Vec<_> = trees
        .iter()
        .zip(&tries)
        .map(|((key, members), trie)| {
            let (TreeKey::Rollout(k) | TreeKey::Group(k)) = *key;
            (trie.as_ref(), members[0] as i32, k)
        })
        .collect();
    Ok(lay_out(&laid, limit, arrays))
}

/// One forest from `trees` (each a trie, its first call and its key), cut at
/// `limit` tokens. Each tree's size is known before it is written, so the
/// arrays are taken once at their exact size from `arrays` and the trees are
/// written in parallel, each into its own part (every element of it): the
/// output depends neither on the thread count nor on the arrays' old contents.
fn lay_out(
    trees: &[(TrieRef<'_, '_, '_>, i32, &str)],
    limit: usize,
    arrays: &impl Arrays,
) -> PackedTree {
    let sizes: Vec<(usize, usize)> = trees
        .par_iter()
        .map(|(t, _, _)| t.packed_size(limit))
        .collect();
    let (tokens, gens) = sizes.iter().fold((0, 0), |(a, b), &(x, y)| (a + x, b + y));
    let mut out = PackedTree::alloc(tokens, gens, trees.len(), arrays);
    let mut slots = Vec::with_capacity(trees.len());
    let mut rest = TreeSlot::all(&mut out);
    for &(t, g) in &sizes {
        let (slot, tail) = rest.split(t, g);
        slots.push(slot);
        rest = tail;
    }
    trees
        .par_iter()
        .zip(slots)
        .for_each(|((trie, _, _), slot)| trie.pack_into(limit, slot));
    let mut at = 0;
    for ((_, first_call, key), &(t, _)) in trees.iter().zip(&sizes) {
        at += t as i64;
        out.tree_offsets.push(at);
        out.tree_call.push(*first_call);
        out.tree_keys.push(key.to_string());
    }
    out
}

/// The packed tree of plain token sequences (one forest, every shared prefix
/// once), for training layouts that start from samples rather than calls: each
/// sequence is inserted as a call whose completion is its last token. Empty
/// sequences are skipped.
pub fn pack_sequences(seqs: &[&[u32]]) -> PackedTree {
    let calls: Vec<CallView<'_>> = seqs
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| CallView {
            rollout_id: "",
            group: None,
            prompt: &s[..s.len() - 1],
            completion: &s[s.len() - 1..],
            logprobs: None,
        })
        .collect();
    let mut trie = Trie::new(&calls);
    for c in 0..calls.len() {
        trie.insert(c);
    }
    // No rollouts here: the one tree has no first call to name.
    lay_out(&[(trie.as_ref(), -1, "")], usize::MAX, &Fresh)
}

/// Child lookup over a [`PackedTree`]: finds the node of every position of a
/// sequence by walking from a root of one of its trees.
///
/// Roots are keyed by their tree, not by the shared parent -1: the trees of a
/// group-packed batch usually start with the same system prompt, and one
/// lookup for all of them would only ever find the first.
#[derive(Debug, Clone, Default)]
pub struct TreeIndex {
    children: HashMap<(i64, u32), i64>,
    trees: usize,
}

impl TreeIndex {
    pub fn new(tree: &PackedTree) -> Self {
        Self::from_parts(&tree.tokens, &tree.parent, &tree.tree_offsets)
    }

    /// The index of a packed tree given as its `tokens`, `parent` and
    /// `tree_offsets` arrays alone (what a lookup reads), without copying them
    /// into a [`PackedTree`].
    pub fn from_parts(tokens: &[u32], parent: &[i64], tree_offsets: &[i64]) -> Self {
        let bounds = tree_offsets;
        let mut children = HashMap::with_capacity(tokens.len());
        let mut k = 0usize;
        for (i, (&p, &t)) in parent.iter().zip(tokens).enumerate() {
            while k + 2 < bounds.len() && i as i64 >= bounds[k + 1] {
                k += 1;
            }
            let parent = if p < 0 { Self::root_key(k) } else { p };
            children.entry((parent, t)).or_insert(i as i64);
        }
        TreeIndex {
            children,
            trees: bounds.len().saturating_sub(1).max(1),
        }
    }

    fn root_key(tree: usize) -> i64 {
        -2 - tree as i64
    }

    /// The node of each position of `tokens`, in the first tree that holds
    /// the whole sequence, or `Err(position)`: the furthest any tree got.
    pub fn locate(&self, tokens: &[u32]) -> Result<Vec<i64>, usize> {
        let mut furthest = 0;
        for k in 0..self.trees {
            match self.locate_in(k, tokens) {
                Ok(nodes) => return Ok(nodes),
                Err(at) => furthest = furthest.max(at),
            }
        }
        Err(furthest)
    }

    /// [`Self::locate`] within tree `tree` only.
    pub fn locate_in(&self, tree: usize, tokens: &[u32]) -> Result<Vec<i64>, usize> {
        let mut node = Self::root_key(tree);
        let mut out = Vec::with_capacity(tokens.len());
        for (k, &t) in tokens.iter().enumerate() {
            node = *self.children.get(&(node, t)).ok_or(k)?;
            out.push(node);
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::arrays::{AnyVec, ArrayPool};

    fn call<'a>(
        rollout: &'a str,
        prompt: &'a [u32],
        completion: &'a [u32],
        logprobs: Option<&'a [f32]>,
    ) -> CallView<'a> {
        CallView {
            rollout_id: rollout,
            group: None,
            prompt,
            completion,
            logprobs,
        }
    }

    /// Two groups whose calls share the system prompt [1, 2]: one tree each.
    fn two_groups_sharing_a_prefix() -> PackedTree {
        let calls = [
            CallView {
                group: Some("g0"),
                ..call("a", &[1, 2], &[3], None)
            },
            CallView {
                group: Some("g1"),
                ..call("b", &[1, 2], &[4], None)
            },
        ];
        pack(&calls, None, true, &Fresh).unwrap()
    }

    #[test]
    fn locate_finds_sequences_in_every_tree_that_starts_alike() {
        // Two groups share a system prompt [1, 2]: one tree each, same roots.
        let tree = two_groups_sharing_a_prefix();
        assert_eq!(tree.tree_keys, vec!["g0", "g1"]);
        let index = TreeIndex::new(&tree);
        assert_eq!(index.locate(&[1, 2, 3]).unwrap(), vec![0, 1, 2]);
        assert_eq!(index.locate(&[1, 2, 4]).unwrap(), vec![3, 4, 5]);
        assert_eq!(index.locate(&[1, 2, 5]), Err(2));
        assert_eq!(index.locate_in(0, &[1, 2, 4]), Err(2));
    }

    #[test]
    fn lcp_finds_first_difference_across_chunks() {
        let a: Vec<u32> = (0..300).collect();
        let mut b = a.clone();
        assert_eq!(lcp(&a, &b), 300);
        b[200] = 9999;
        assert_eq!(lcp(&a, &b), 200);
        assert_eq!(lcp(&a[..10], &b), 10);
        assert_eq!(lcp(&[], &b), 0);
        // Pieces split at different points still compare as one sequence.
        assert_eq!(lcp_pieces([&a[..5], &a[5..50]], [&a[..30], &a[30..40]]), 40);
        assert_eq!(lcp_pieces([&a[..5], &[]], [&[], &a[..3]]), 3);
    }

    #[test]
    fn lcp_pairs_sums_each_pairs_common_prefix() {
        let a: Vec<u32> = (0..200).collect();
        let mut b = a.clone();
        b[150] = 0;
        let pairs: [(&[u32], &[u32]); 4] = [(&a, &b), (&a[..7], &a), (&[], &a), (&a[1..], &a)];
        // The obvious count: walk each pair until the first difference.
        let plain: usize = pairs
            .iter()
            .map(|(x, y)| x.iter().zip(y.iter()).take_while(|(p, q)| p == q).count())
            .sum();
        assert_eq!((lcp_pairs(&pairs), plain), (157, 157));
        assert_eq!(lcp_pairs(&[]), 0);
    }

    #[test]
    fn sample_columns_take_the_plans_writes() {
        let calls = [
            call("r", &[1, 2], &[3], None),
            call("r", &[1, 4], &[5], None),
        ];
        let p = plan(&calls, None).unwrap();
        let pool = ArrayPool::new(8);
        pool.give(AnyVec::U32(vec![99; 8]));
        let mut cols = SampleColumns::take(p.stats.sample_tokens, &pool);
        p.write(&calls, cols.as_mut());
        // The same merge written sample by sample, then laid end to end.
        let m = merge(&calls, None).unwrap();
        let flat = |f: fn(&Sample) -> Vec<u32>| m.samples.iter().flat_map(f).collect::<Vec<_>>();
        assert_eq!(cols.tokens, flat(|s| s.tokens.clone()));
        let call_index: Vec<i32> = m
            .samples
            .iter()
            .flat_map(|s| s.call_index.clone())
            .collect();
        let weights: Vec<f32> = m.samples.iter().flat_map(|s| s.weights.clone()).collect();
        let logprobs: Vec<u32> = m
            .samples
            .iter()
            .flat_map(|s| s.logprobs.iter().map(|l| l.to_bits()))
            .collect();
        assert_eq!((cols.call_index, cols.weights), (call_index, weights));
        assert_eq!(
            cols.logprobs
                .iter()
                .map(|l| l.to_bits())
                .collect::<Vec<_>>(),
            logprobs
        );
    }

    #[test]
    fn index_from_parts_is_the_trees_index() {
        let tree = two_groups_sharing_a_prefix();
        let parts = TreeIndex::from_parts(&tree.tokens, &tree.parent, &tree.tree_offsets);
        let whole = TreeIndex::new(&tree);
        for seq in [&[1, 2, 3][..], &[1, 2, 4], &[1, 2, 5], &[2]] {
            assert_eq!(parts.locate(seq), whole.locate(seq));
        }
        assert_eq!(TreeIndex::from_parts(&[], &[], &[]).locate(&[1]), Err(0));
    }

    #[test]
    fn multi_turn_collapses_into_one_sample() {
        let lp0 = [-0.5f32, -0.25];
        let calls = [
            call("r", &[1, 2, 3], &[10, 11], Some(&lp0)),
            call("r", &[1, 2, 3, 10, 11, 20], &[30], None),
            call("r", &[1, 2, 3, 10, 11, 20, 30, 21], &[40, 41], None),
        ];
        let m = merge(&calls, None).unwrap();
        assert_eq!(m.samples.len(), 1);
        let s = &m.samples[0];
        assert_eq!(s.tokens, vec![1, 2, 3, 10, 11, 20, 30, 21, 40, 41]);
        assert_eq!(s.weights, vec![0., 0., 0., 1., 1., 0., 1., 0., 1., 1.]);
        assert_eq!(s.call_index, vec![-1, -1, -1, 0, 0, -1, 1, -1, 2, 2]);
        assert_eq!(&s.logprobs[3..5], &lp0);
        assert!(s.logprobs[6].is_nan());
        assert!(m.divergences.is_empty());
        assert_eq!(m.stats.generated_tokens, 5);
        assert_eq!(m.stats.sample_tokens, 10);
    }

    #[test]
    fn departure_from_generated_path_is_a_divergence() {
        // Call 1 re-tokenized call 0's completion [3, 4] as [3, 5].
        let calls = [
            call("r", &[1, 2], &[3, 4], None),
            call("r", &[1, 2, 3, 5, 6], &[7], None),
        ];
        let m = merge(&calls, None).unwrap();
        assert_eq!(m.samples.len(), 2);
        assert_eq!(m.samples[0].tokens, vec![1, 2, 3, 4]);
        assert_eq!(m.samples[0].weights, vec![0., 0., 1., 1.]);
        // Token 3 at depth 2 is shared: trained once, in the first sample.
        assert_eq!(m.samples[1].tokens, vec![1, 2, 3, 5, 6, 7]);
        assert_eq!(m.samples[1].weights, vec![0., 0., 0., 0., 0., 1.]);
        assert_eq!(m.samples[1].logprobs.len(), 6);
        assert_eq!(
            m.divergences,
            vec![Divergence {
                rollout_id: "r".into(),
                call_index: 1,
                position: 3,
                left_call_index: 0,
                kind: DivergenceKind::Unclassified,
            }]
        );
    }

    #[test]
    fn completion_branches_are_not_divergences() {
        // Same prompt, two sampled completions (a retry): a branch, not a divergence.
        let calls = [
            call("r", &[1, 2], &[3, 4], None),
            call("r", &[1, 2], &[3, 9], None),
        ];
        let m = merge(&calls, None).unwrap();
        assert_eq!(m.samples.len(), 2);
        assert!(m.divergences.is_empty());
        assert_eq!(m.samples[1].weights, vec![0., 0., 0., 1.]);
    }

    #[test]
    fn left_call_is_the_latest_on_the_path_left() {
        let calls = [
            call("r", &[1], &[2], None),
            call("r", &[1, 2, 3], &[4], None),
            call("r", &[1, 2, 3, 4, 5], &[6], None),
            call("r", &[1, 2, 7], &[8], None),
        ];
        let m = merge(&calls, None).unwrap();
        assert_eq!(m.divergences.len(), 1);
        assert_eq!(m.divergences[0].position, 2);
        assert_eq!(m.divergences[0].left_call_index, 2);
    }

    #[test]
    fn duplicates_weigh_and_are_counted() {
        let lp = [-1.0f32];
        let calls = [
            call("r", &[1], &[2], None),
            call("r", &[1], &[2], Some(&lp)),
            call("r", &[1, 2], &[3], None),
        ];
        let m = merge(&calls, None).unwrap();
        assert_eq!(m.samples.len(), 1);
        assert_eq!(m.samples[0].weights, vec![0., 2., 1.]);
        assert_eq!(m.samples[0].call_index, vec![-1, 0, 2]);
        // The first generator has no logprobs; the second's is used.
        assert_eq!(m.samples[0].logprobs[1], -1.0);
        assert_eq!(m.stats.duplicates, 1);
    }

    #[test]
    fn split_keeps_generation_spans_on_both_halves() {
        // Call 1's sequence ends inside call 0's completion: the edge splits.
        let calls = [
            call("r", &[1], &[2, 3, 4], None),
            call("r", &[1, 2], &[3], None),
        ];
        let mut t = Trie::new(&calls);
        t.insert(0);
        t.insert(1);
        assert_eq!(t.lookup(0, 1).map(|p| (p.0, p.1)), Some((1, 0)));
        assert_eq!(t.lookup(0, 2).map(|p| (p.0, p.1)), Some((2, 0)));
        assert_eq!(t.lookup(0, 3).map(|p| (p.0, p.1)), Some((1, 0)));
        assert_eq!(t.lookup(0, 0).map(|p| (p.0, p.1)), Some((0, -1)));
        let m = merge(&calls, None).unwrap();
        assert_eq!(m.samples.len(), 1);
        assert_eq!(m.samples[0].weights, vec![0., 1., 2., 1.]);
    }

    #[test]
    fn truncation_reports_cut_tokens_and_drops_empty_samples() {
        let calls = [
            call("r", &[1, 2], &[3, 4, 5], None),
            call("r", &[1, 2], &[3, 4, 6], None),
        ];
        let m = merge(&calls, Some(3)).unwrap();
        // The second path only differs beyond the limit: nothing left to train.
        assert_eq!(m.samples.len(), 1);
        assert_eq!(m.samples[0].tokens, vec![1, 2, 3]);
        assert_eq!(m.samples[0].weights, vec![0., 0., 2.]);
        assert_eq!(m.samples[0].truncated, 3);
        assert_eq!(m.stats.truncated_tokens, 4);
        assert_eq!(m.stats.dropped_samples, 1);
        assert!(matches!(
            merge(&calls, Some(0)),
            Err(CoreError::InvalidOption(_))
        ));
    }

    #[test]
    fn rollouts_are_separate_tries_in_first_appearance_order() {
        let calls = [
            call("b", &[1], &[2], None),
            call("a", &[1], &[2], None),
            call("b", &[1, 2], &[3], None),
        ];
        let m = merge(&calls, None).unwrap();
        let ids: Vec<_> = m.samples.iter().map(|s| s.rollout_id.as_str()).collect();
        assert_eq!(ids, ["b", "a"]);
        assert_eq!(m.samples[0].call_index, vec![-1, 0, 2]);
        assert_eq!(m.samples[1].call_index, vec![-1, 1]);
        assert_eq!(m.stats.duplicates, 0);
    }

    #[test]
    fn invalid_calls_name_their_index() {
        let lp = [0.0f32; 2];
        let bad_len = [
            call("r", &[1], &[2], None),
            call("r", &[1], &[2], Some(&lp)),
        ];
        let err = merge(&bad_len, None).unwrap_err().to_string();
        assert!(err.starts_with("call 1:"), "{err}");
        assert!(err.contains("logprobs has 2 entries"), "{err}");
        let empty = [call("r", &[1], &[], None)];
        let err = merge(&empty, None).unwrap_err().to_string();
        assert!(
            err.starts_with("call 0:") && err.contains("empty completion"),
            "{err}"
        );
        let mut grouped = [call("r", &[1], &[2], None), call("r", &[1], &[3], None)];
        grouped[1].group = Some("g");
        let err = merge(&grouped, None).unwrap_err().to_string();
        assert!(err.contains("group \"g\" differs from group None"), "{err}");
    }

    #[test]
    fn pack_shares_a_group_prompt_once() {
        let mut calls = [
            call("r1", &[1, 2], &[3], None),
            call("r2", &[1, 2], &[4], None),
            call("r3", &[1, 2], &[3], None),
        ];
        for c in &mut calls {
            c.group = Some("g");
        }
        let p = pack(&calls, None, true, &Fresh).unwrap();
        assert_eq!(p.tokens, vec![1, 2, 3, 4]);
        assert_eq!(p.parent, vec![-1, 0, 1, 1]);
        assert_eq!(p.depth, vec![0, 1, 2, 2]);
        assert_eq!(p.weights, vec![0., 0., 2., 1.]);
        assert_eq!(p.gen_offsets, vec![0, 0, 0, 2, 3]);
        assert_eq!(p.gen_call, vec![0, 2, 1]);
        assert_eq!(p.tree_keys, vec!["g".to_string()]);
        assert_eq!(p.tree_call, vec![0]);
        assert_eq!(
            p.by_first_generator(&[10, 11, 12], -1, &Fresh),
            vec![-1, -1, 10, 11]
        );
        assert_eq!(p.by_tree(&[7], &Fresh), vec![7; 4]);
        assert_eq!(p.tree_offsets, vec![0, 4]);
        let per_rollout = pack(&calls, None, false, &Fresh).unwrap();
        assert_eq!(per_rollout.tokens.len(), 9);
        assert_eq!(per_rollout.tree_keys, ["r1", "r2", "r3"]);
        assert_eq!(per_rollout.tree_call, vec![0, 1, 2]);
        assert_eq!(
            per_rollout.by_tree(&[0, 1, 2], &Fresh),
            vec![0, 0, 0, 1, 1, 1, 2, 2, 2]
        );
        let cut = pack(&calls, Some(2), true, &Fresh).unwrap();
        assert_eq!(cut.tokens, vec![1, 2]);
        // The output was sized exactly up front, cut or not.
        for t in [&p, &per_rollout, &cut] {
            assert_eq!(t.tokens.capacity(), t.tokens.len());
            assert_eq!(t.gen_call.capacity(), t.gen_call.len());
            assert_eq!(t.gen_offsets.capacity(), t.gen_offsets.len());
        }
    }

    #[test]
    fn plan_pack_lays_out_the_plans_tries_as_pack_builds_them() {
        // Interleaved rollouts with a branch (r1's third call rewrites history),
        // a duplicate, logprobs, and limits that cut inside prompts and completions.
        let lp = [-0.5f32, -0.25];
        let calls = [
            call("r1", &[1, 2], &[3, 4], Some(&lp)),
            call("r2", &[1, 2], &[5], None),
            call("r1", &[1, 2, 3, 4, 6], &[7], None),
            call("r2", &[1, 2, 5, 8], &[9, 10], Some(&lp)),
            call("r1", &[1, 2, 9], &[7], None),
            call("r2", &[1, 2, 5, 8], &[9, 10], Some(&lp)),
        ];
        // A pool full of stale arrays of every length up to the output's.
        let pool = ArrayPool::new(1024);
        let refill = || {
            for len in 1..=40 {
                for _ in 0..4 {
                    pool.give(AnyVec::U32(vec![0xdead_beef; len]));
                    pool.give(AnyVec::I32(vec![-7; len]));
                    pool.give(AnyVec::I64(vec![i64::MIN; len]));
                    pool.give(AnyVec::F32(vec![f32::NAN; len]));
                }
            }
        };
        // NaN marks untrained logprobs: compare those bit for bit.
        let bits = |t: &PackedTree| t.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let strip = |t: &PackedTree| PackedTree {
            logprobs: Vec::new(),
            ..t.clone()
        };
        for max_tokens in [None, Some(1), Some(3), Some(5), Some(100)] {
            let p = plan(&calls, max_tokens).unwrap();
            let from_plan = p.pack(&calls, max_tokens, &Fresh).unwrap();
            let built = pack(&calls, max_tokens, false, &Fresh).unwrap();
            assert_eq!(bits(&from_plan), bits(&built), "{max_tokens:?}");
            assert_eq!(strip(&from_plan), strip(&built), "{max_tokens:?}");
            // Written into stale arrays, every output is the same.
            for across in [false, true] {
                let fresh = pack(&calls, max_tokens, across, &Fresh).unwrap();
                refill();
                let reused = if across {
                    pack(&calls, max_tokens, true, &pool).unwrap()
                } else {
                    p.pack(&calls, max_tokens, &pool).unwrap()
                };
                assert_eq!(bits(&reused), bits(&fresh), "{max_tokens:?} {across}");
                assert_eq!(strip(&reused), strip(&fresh), "{max_tokens:?} {across}");
                let by_call = [10i64, 11, 12, 13, 14, 15];
                refill();
                assert_eq!(
                    reused.by_first_generator(&by_call, -1, &pool),
                    fresh.by_first_generator(&by_call, -1, &Fresh)
                );
                let by_tree: Vec<i32> = (0..fresh.tree_call.len() as i32).collect();
                refill();
                assert_eq!(
                    reused.by_tree(&by_tree, &pool),
                    fresh.by_tree(&by_tree, &Fresh)
                );
            }
            assert_eq!(from_plan.tree_keys, ["r1", "r2"]);
            // Both were sized exactly up front (cuts and shared nodes included).
            for t in [&from_plan, &built] {
                assert_eq!(t.tokens.capacity(), t.tokens.len(), "{max_tokens:?}");
                assert_eq!(t.gen_call.capacity(), t.gen_call.len(), "{max_tokens:?}");
            }
        }
        let p = plan(&calls, None).unwrap();
        assert!(p.pack(&calls, Some(0), &Fresh).is_err());
    }

    #[test]
    fn pack_sequences_shares_prefixes_and_locates_paths() {
        let seqs: [&[u32]; 4] = [&[1, 2, 3], &[1, 2, 4, 5], &[], &[7]];
        let p = pack_sequences(&seqs);
        assert_eq!(p.tokens, vec![1, 2, 3, 4, 5, 7]);
        assert_eq!(p.parent, vec![-1, 0, 1, 1, 3, -1]);
        assert_eq!(p.depth, vec![0, 1, 2, 2, 3, 0]);
        let index = TreeIndex::new(&p);
        assert_eq!(index.locate(&[1, 2, 4, 5]), Ok(vec![0, 1, 3, 4]));
        assert_eq!(index.locate(&[1, 2]), Ok(vec![0, 1]));
        assert_eq!(index.locate(&[1, 9]), Err(1));
        assert_eq!(index.locate(&[]), Ok(vec![]));
    }
}
