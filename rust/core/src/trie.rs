//! Radix-trie merge of a rollout's calls into training samples (DESIGN.md §5).
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

use crate::error::CoreError;
use crate::trace::{CallView, Divergence, DivergenceKind, Merged, PackedTree, Sample};

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
fn lcp(a: &[u32], b: &[u32]) -> usize {
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

    /// Append `node`'s tokens below `limit` to `out`.
    #[inline]
    fn extend_tokens(&self, node: usize, limit: usize, out: &mut Vec<u32>) {
        let n = &self.nodes[node];
        let end = (n.end as usize).min(limit);
        if (n.start as usize) < end {
            for piece in self.calls[n.src as usize].pieces(n.start as usize, end) {
                out.extend_from_slice(piece);
            }
        }
    }

    /// Root-to-leaf paths, DFS in creation order, cut at `limit` tokens. `map`
    /// turns trie call indices into the indices reported to the user.
    /// Returns the samples (without rollout id/group) and the dropped count.
    fn samples(&self, limit: usize, map: &[usize]) -> (Vec<Sample>, usize) {
        let mut out = Vec::new();
        let mut dropped = 0;
        let mut visited = vec![false; self.nodes.len()];
        // (node, next child to visit)
        let mut stack: Vec<(usize, usize)> = vec![(ROOT, 0)];
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            let children = &self.nodes[node].children;
            if node != ROOT && children.is_empty() {
                let path: Vec<usize> = stack[1..].iter().map(|&(n, _)| n).collect();
                let sample = self.emit(&path, limit, map, &mut visited);
                if sample.weights.iter().any(|&w| w > 0.0) {
                    out.push(sample);
                } else {
                    dropped += 1;
                }
                stack.pop();
            } else if *next < children.len() {
                let ch = children[*next] as usize;
                *next += 1;
                stack.push((ch, 0));
            } else {
                stack.pop();
            }
        }
        (out, dropped)
    }

    fn emit(&self, path: &[usize], limit: usize, map: &[usize], visited: &mut [bool]) -> Sample {
        let full = path.last().map_or(0, |&n| self.nodes[n].end as usize);
        let len = full.min(limit);
        let mut tokens = Vec::with_capacity(len);
        let mut weights = vec![0f32; len];
        let mut logprobs = vec![f32::NAN; len];
        let mut call_index = vec![-1i32; len];
        let mut truncated = 0usize;
        for &node in path {
            self.extend_tokens(node, limit, &mut tokens);
            let n = &self.nodes[node];
            let first_visit = !visited[node];
            visited[node] = true;
            for g in &n.gens {
                let call = self.calls[g.call as usize];
                let (from, to) = (g.from as usize, g.to as usize);
                if first_visit {
                    truncated += to.saturating_sub(from.max(limit));
                }
                let to = to.min(limit);
                if from >= to {
                    continue;
                }
                let user_call = map[g.call as usize] as i32;
                if first_visit {
                    for w in &mut weights[from..to] {
                        *w += 1.0;
                    }
                    for ci in &mut call_index[from..to] {
                        if *ci < 0 {
                            *ci = user_call;
                        }
                    }
                }
                if let Some(l) = call.logprobs {
                    let off = call.prompt.len();
                    for (dst, &src) in logprobs[from..to].iter_mut().zip(&l[from - off..to - off]) {
                        if dst.is_nan() {
                            *dst = src;
                        }
                    }
                }
            }
        }
        Sample {
            rollout_id: String::new(),
            group: None,
            tokens,
            weights,
            logprobs,
            call_index,
            truncated,
        }
    }

    /// Append this trie as one tree of `out`, cut at `limit` tokens.
    fn pack_into(&self, limit: usize, map: &[usize], out: &mut PackedTree) {
        // (node, next child, index of the node's last token in `out`)
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
            if n.start as usize >= limit {
                continue;
            }
            let end = (n.end as usize).min(limit) as u32;
            let first = out.tokens.len() as i64;
            self.extend_tokens(ch, limit, &mut out.tokens);
            for (i, d) in (n.start..end).enumerate() {
                out.parent.push(if i == 0 {
                    parent_last
                } else {
                    first + i as i64 - 1
                });
                out.depth.push(d as i64);
                let mut count = 0u32;
                let mut lp = f32::NAN;
                for g in &n.gens {
                    if g.from <= d && d < g.to {
                        count += 1;
                        out.gen_call.push(map[g.call as usize] as i32);
                        if lp.is_nan() {
                            lp = self.calls[g.call as usize].logprob_at(d as usize);
                        }
                    }
                }
                out.weights.push(count as f32);
                out.logprobs.push(lp);
                out.gen_offsets.push(out.gen_call.len() as i64);
            }
            let last = out.tokens.len() as i64 - 1;
            stack.push((ch, 0, last));
        }
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
                return Some(self.position(n, depth as u32));
            }
            d = n.end as usize;
            node = ch;
        }
        None
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

/// Merge calls into training samples, one trie per rollout (grouped by rollout
/// id, input order kept within a rollout). Call indices in the output index
/// `calls`. Divergences are reported with kind `Unclassified`.
pub fn merge(calls: &[CallView<'_>], max_tokens: Option<usize>) -> Result<Merged, CoreError> {
    let limit = check(calls, max_tokens)?;
    let rollouts = group_by(calls, |c| c.rollout_id);
    let mut merged = Merged::default();
    let mut local: Vec<CallView<'_>> = Vec::new();
    for (rollout_id, members) in &rollouts {
        let group = calls[members[0]].group;
        local.clear();
        for &i in members {
            if calls[i].group != group {
                return Err(CoreError::InvalidCall {
                    index: i,
                    message: format!(
                        "group {} differs from group {} of call {} in the same rollout {:?}; \
                         every call of a rollout must carry the same group",
                        show_group(calls[i].group),
                        show_group(group),
                        members[0],
                        rollout_id
                    ),
                });
            }
            local.push(calls[i]);
        }
        let mut trie = Trie::new(&local);
        for (li, &gi) in members.iter().enumerate() {
            let ins = trie.insert(li);
            if let Some((position, left)) = ins.divergence {
                merged.divergences.push(Divergence {
                    rollout_id: rollout_id.to_string(),
                    call_index: gi,
                    position,
                    left_call_index: members[left],
                    kind: DivergenceKind::Unclassified,
                });
            }
            merged.stats.duplicates += usize::from(ins.duplicate);
        }
        let (samples, dropped) = trie.samples(limit, members);
        merged.stats.dropped_samples += dropped;
        for mut s in samples {
            s.rollout_id = rollout_id.to_string();
            s.group = group.map(str::to_string);
            merged.stats.sample_tokens += s.tokens.len();
            merged.samples.push(s);
        }
    }
    let stats = &mut merged.stats;
    stats.calls = calls.len();
    stats.rollouts = rollouts.len();
    stats.samples = merged.samples.len();
    for c in calls {
        stats.generated_tokens += c.completion.len();
        stats.truncated_tokens += c.len().saturating_sub(c.prompt.len().max(limit));
    }
    Ok(merged)
}

/// Key of the tree a call goes into when packing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum TreeKey<'a> {
    Rollout(&'a str),
    Group(&'a str),
}

/// The packed-tree form: one tree per rollout, or with `across_rollouts` one
/// tree per group (calls without a group stay in their rollout's tree), in order
/// of first appearance.
pub fn pack(
    calls: &[CallView<'_>],
    max_tokens: Option<usize>,
    across_rollouts: bool,
) -> Result<PackedTree, CoreError> {
    let limit = check(calls, max_tokens)?;
    let trees = group_by(calls, |c| match (across_rollouts, c.group) {
        (true, Some(g)) => TreeKey::Group(g),
        _ => TreeKey::Rollout(c.rollout_id),
    });
    let mut out = PackedTree {
        gen_offsets: vec![0],
        tree_offsets: vec![0],
        ..PackedTree::default()
    };
    let mut local: Vec<CallView<'_>> = Vec::new();
    for (key, members) in &trees {
        local.clear();
        local.extend(members.iter().map(|&i| calls[i]));
        let mut trie = Trie::new(&local);
        for li in 0..local.len() {
            trie.insert(li);
        }
        trie.pack_into(limit, members, &mut out);
        out.tree_offsets.push(out.tokens.len() as i64);
        out.tree_keys.push(match key {
            TreeKey::Rollout(s) | TreeKey::Group(s) => s.to_string(),
        });
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
        let p = pack(&calls, None, true).unwrap();
        assert_eq!(p.tokens, vec![1, 2, 3, 4]);
        assert_eq!(p.parent, vec![-1, 0, 1, 1]);
        assert_eq!(p.depth, vec![0, 1, 2, 2]);
        assert_eq!(p.weights, vec![0., 0., 2., 1.]);
        assert_eq!(p.gen_offsets, vec![0, 0, 0, 2, 3]);
        assert_eq!(p.gen_call, vec![0, 2, 1]);
        assert_eq!(p.tree_keys, vec!["g".to_string()]);
        assert_eq!(p.tree_offsets, vec![0, 4]);
        let per_rollout = pack(&calls, None, false).unwrap();
        assert_eq!(per_rollout.tokens.len(), 9);
        assert_eq!(per_rollout.tree_keys, ["r1", "r2", "r3"]);
        let cut = pack(&calls, Some(2), true).unwrap();
        assert_eq!(cut.tokens, vec![1, 2]);
    }
}
