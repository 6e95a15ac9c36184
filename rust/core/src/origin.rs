//! Where each call, sample and token of a merge comes from: its rollout (an
//! index into the merge's rollouts), its group (an index into the merge's
//! distinct groups) and the weight version of the call that generated it.
//!
//! The trainer credits rewards and measures staleness per token, so these are
//! flat index arrays beside the merge's outputs rather than a field on every
//! sample object.

use std::collections::HashMap;

use crate::arrays::Arrays;
use crate::error::CoreError;
use crate::trace::{CallView, PackedTree};
use crate::trie::{pack, MergePlan, SampleInfo};

/// A rollout record passed in with the calls: the rollouts a merge reports
/// start with these, in this order, whether or not any call belongs to them.
#[derive(Debug, Clone, Copy)]
pub struct RolloutKey<'a> {
    pub rollout_id: &'a str,
    pub group: Option<&'a str>,
}

/// The rollouts of a merge and every call's rollout, group and weight version.
#[derive(Debug, Clone, Default)]
pub struct CallIndex {
    /// Rollout (index into the merge's rollouts) of each call.
    pub rollout: Vec<i32>,
    /// Group (index into `groups`, -1 for none) of each call.
    pub group: Vec<i32>,
    /// Weight version of each call (saturated at `i64::MAX`: numpy's int64).
    pub version: Vec<i64>,
    /// The distinct groups of the merge's rollouts, in rollout order.
    pub groups: Vec<String>,
    /// The first call (input index) of each rollout the records did not list,
    /// in order of first appearance: rollout `given.len() + k` is named by
    /// call `unlisted[k]` (its id and group).
    pub unlisted: Vec<usize>,
}

/// One kept sample of a merge: where it lies in the flat sample arrays and
/// which rollout it belongs to.
#[derive(Debug, Clone, Copy)]
pub struct SampleSpan<'a> {
    pub info: SampleInfo<'a>,
    /// Offset of its first token in the flat sample arrays.
    pub start: usize,
    /// Its rollout (index into the merge's rollouts).
    pub rollout: usize,
}

/// Per token of a packed tree: where it came from (see [`CallIndex::pack`]).
#[derive(Debug, Clone, Default)]
pub struct TokenOrigin {
    /// Rollout of each token's first generating call, -1 for context.
    pub rollout: Vec<i32>,
    /// Group of each token's tree, -1 without a group.
    pub group: Vec<i32>,
    /// Weight version of each token's first generating call, -1 for context.
    pub weight_version: Vec<i64>,
    /// Rollout of every input call.
    pub call_rollout: Vec<i32>,
    /// The merge's distinct groups (what `group` indexes).
    pub groups: Vec<String>,
}

impl TokenOrigin {
    /// `tokens` tokens of no rollout, group or version: plain sequences.
    pub fn none(tokens: usize) -> Self {
        TokenOrigin {
            rollout: vec![-1; tokens],
            group: vec![-1; tokens],
            weight_version: vec![-1; tokens],
            call_rollout: Vec::new(),
            groups: Vec::new(),
        }
    }
}

/// An optional string as Python shows it (`None` or a quoted string): the
/// messages name values as the caller wrote them.
fn shown(s: Option<&str>) -> String {
    s.map_or_else(|| "None".to_string(), |s| format!("{s:?}"))
}

impl CallIndex {
    /// Index `calls` (with `versions[i]` the weight version of call `i`)
    /// against the rollout records `given`. A rollout listed twice, or a call
    /// whose group differs from its rollout's (the record's, or for an unlisted
    /// rollout its first call's), is an error.
    pub fn new(
        given: &[RolloutKey<'_>],
        calls: &[CallView<'_>],
        versions: &[u64],
    ) -> Result<Self, CoreError> {
        let mut group_of: Vec<Option<&str>> = given.iter().map(|r| r.group).collect();
        let mut at: HashMap<&str, usize> = HashMap::with_capacity(given.len());
        for (i, r) in given.iter().enumerate() {
            if at.insert(r.rollout_id, i).is_some() {
                return Err(CoreError::InvalidOption(format!(
                    "rollouts lists {:?} twice; pass each rollout once",
                    r.rollout_id
                )));
            }
        }
        let mut index = CallIndex {
            rollout: Vec::with_capacity(calls.len()),
            group: Vec::with_capacity(calls.len()),
            version: versions
                .iter()
                .map(|&v| i64::try_from(v).unwrap_or(i64::MAX))
                .collect(),
            ..CallIndex::default()
        };
        for (i, c) in calls.iter().enumerate() {
            let r = match at.get(c.rollout_id) {
                Some(&r) => {
                    if group_of[r] != c.group {
                        return Err(CoreError::InvalidCall {
                            index: i,
                            message: format!(
                                "group {} differs from group {} of its rollout {:?}; \
                                 pass the rollout records the calls were read with",
                                shown(c.group),
                                shown(group_of[r]),
                                c.rollout_id
                            ),
                        });
                    }
                    r
                }
                None => {
                    at.insert(c.rollout_id, group_of.len());
                    group_of.push(c.group);
                    index.unlisted.push(i);
                    group_of.len() - 1
                }
            };
            index.rollout.push(r as i32);
        }
        let mut group_at: HashMap<&str, i32> = HashMap::new();
        for g in group_of.iter().flatten() {
            if !group_at.contains_key(g) {
                group_at.insert(g, index.groups.len() as i32);
                index.groups.push(g.to_string());
            }
        }
        index.group = calls
            .iter()
            .map(|c| c.group.and_then(|g| group_at.get(g).copied()).unwrap_or(-1))
            .collect();
        Ok(index)
    }

    /// The kept samples of `plan` in output order, each with its offset in the
    /// flat sample arrays (they lie back to back) and its rollout. `calls` must
    /// be the calls planned from and indexed.
    pub fn spans<'p, 'a>(
        &'p self,
        plan: &'p MergePlan,
        calls: &'p [CallView<'a>],
    ) -> impl Iterator<Item = SampleSpan<'a>> + 'p {
        plan.samples(calls).scan(0, move |start, info| {
            let span = SampleSpan {
                info,
                start: *start,
                rollout: self.rollout[info.first_call] as usize,
            };
            *start += info.len;
            Some(span)
        })
    }

    /// The weight version of each entry of `call_index` (a sample's generating
    /// call per token), -1 for context.
    pub fn versions_of(&self, call_index: &[i32]) -> Vec<i64> {
        call_index
            .iter()
            .map(|&c| if c < 0 { -1 } else { self.version[c as usize] })
            .collect()
    }

    /// The packed tree of `calls` and where each of its tokens came from: one
    /// tree per rollout (laid out from `plan`'s tries rather than built again),
    /// or with `across_rollouts` one per group. Arrays come from `arrays`.
    pub fn pack(
        &self,
        plan: &MergePlan,
        calls: &[CallView<'_>],
        max_tokens: Option<usize>,
        across_rollouts: bool,
        arrays: &impl Arrays,
    ) -> Result<(PackedTree, TokenOrigin), CoreError> {
        let t = if across_rollouts {
            pack(calls, max_tokens, true, arrays)?
        } else {
            plan.pack(calls, max_tokens, arrays)?
        };
        let tree_group: Vec<i32> = t
            .tree_call
            .iter()
            .map(|&c| self.group[c as usize])
            .collect();
        let origin = TokenOrigin {
            rollout: t.by_first_generator(&self.rollout, -1, arrays),
            group: t.by_tree(&tree_group, arrays),
            weight_version: t.by_first_generator(&self.version, -1, arrays),
            call_rollout: self.rollout.clone(),
            groups: self.groups.clone(),
        };
        Ok((t, origin))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::arrays::Fresh;
    use crate::trie::plan;

    /// Slow, obvious twin of [`CallIndex::new`] (without the error checks):
    /// rollouts are the records, then each new id in call order; groups are
    /// the rollouts' distinct groups in rollout order, found by linear search.
    fn reference(
        given: &[RolloutKey<'_>],
        calls: &[CallView<'_>],
    ) -> (Vec<i32>, Vec<i32>, Vec<String>, Vec<usize>) {
        let mut rollouts: Vec<(&str, Option<&str>)> =
            given.iter().map(|r| (r.rollout_id, r.group)).collect();
        let mut unlisted = Vec::new();
        let mut rollout = Vec::new();
        for (i, c) in calls.iter().enumerate() {
            match rollouts.iter().position(|r| r.0 == c.rollout_id) {
                Some(r) => rollout.push(r as i32),
                None => {
                    rollouts.push((c.rollout_id, c.group));
                    unlisted.push(i);
                    rollout.push(rollouts.len() as i32 - 1);
                }
            }
        }
        let mut groups: Vec<String> = Vec::new();
        for g in rollouts.iter().filter_map(|r| r.1) {
            if !groups.iter().any(|x| x == g) {
                groups.push(g.to_string());
            }
        }
        let group = calls
            .iter()
            .map(|c| match c.group {
                Some(g) => groups.iter().position(|x| x == g).unwrap() as i32,
                None => -1,
            })
            .collect();
        (rollout, group, groups, unlisted)
    }

    fn call<'a>(
        rollout: &'a str,
        group: Option<&'a str>,
        prompt: &'a [u32],
        completion: &'a [u32],
    ) -> CallView<'a> {
        CallView {
            rollout_id: rollout,
            group,
            prompt,
            completion,
            logprobs: None,
        }
    }

    /// A small deterministic generator (xorshift), so the cases are reproducible.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    const IDS: [&str; 6] = ["r0", "r1", "r2", "r3", "r4", "r5"];
    const GROUPS: [Option<&str>; 4] = [None, Some("ga"), Some("gb"), Some("gc")];
    const TOKENS: [u32; 6] = [1, 2, 3, 4, 5, 6];

    /// Rollout `k`'s group is fixed, so generated cases never disagree.
    fn group_of(k: usize) -> Option<&'static str> {
        GROUPS[k * 7 % GROUPS.len()]
    }

    #[test]
    fn index_matches_the_reference_on_generated_cases() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..500 {
            let mut ids: Vec<usize> = (0..IDS.len()).collect();
            let mut given = Vec::new();
            for _ in 0..rng.below(4) {
                let k = ids.swap_remove(rng.below(ids.len()));
                given.push(RolloutKey {
                    rollout_id: IDS[k],
                    group: group_of(k),
                });
            }
            let calls: Vec<CallView<'_>> = (0..rng.below(12))
                .map(|_| {
                    let k = rng.below(IDS.len());
                    call(IDS[k], group_of(k), &TOKENS[..1], &TOKENS[1..2])
                })
                .collect();
            let versions: Vec<u64> = (0..calls.len()).map(|i| i as u64 * 3).collect();
            let index = CallIndex::new(&given, &calls, &versions).unwrap();
            let (rollout, group, groups, unlisted) = reference(&given, &calls);
            assert_eq!(index.rollout, rollout);
            assert_eq!(index.group, group);
            assert_eq!(index.groups, groups);
            assert_eq!(index.unlisted, unlisted);
            assert_eq!(
                index.version,
                versions.iter().map(|&v| v as i64).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn index_keeps_records_without_calls_and_their_groups_first() {
        let given = [
            RolloutKey {
                rollout_id: "idle",
                group: Some("g1"),
            },
            RolloutKey {
                rollout_id: "b",
                group: Some("g0"),
            },
        ];
        let calls = [
            call("a", Some("g0"), &[1], &[2]),
            call("b", Some("g0"), &[1], &[3]),
        ];
        let index = CallIndex::new(&given, &calls, &[7, u64::MAX]).unwrap();
        assert_eq!(index.rollout, vec![2, 1]);
        assert_eq!(index.unlisted, vec![0]);
        assert_eq!(index.groups, vec!["g1", "g0"]);
        assert_eq!(index.group, vec![1, 1]);
        // numpy has no uint64 weight-version column: the largest saturates.
        assert_eq!(index.version, vec![7, i64::MAX]);
    }

    #[test]
    fn index_refuses_a_rollout_listed_twice_or_a_group_that_disagrees() {
        let twice = [
            RolloutKey {
                rollout_id: "a",
                group: None,
            },
            RolloutKey {
                rollout_id: "a",
                group: None,
            },
        ];
        let err = CallIndex::new(&twice, &[], &[]).unwrap_err();
        assert!(matches!(err, CoreError::InvalidOption(_)));
        assert_eq!(
            err.to_string(),
            "rollouts lists \"a\" twice; pass each rollout once"
        );

        let given = [RolloutKey {
            rollout_id: "a",
            group: Some("g"),
        }];
        let calls = [
            call("a", Some("g"), &[1], &[2]),
            call("a", None, &[1], &[2]),
        ];
        let err = CallIndex::new(&given, &calls, &[0, 0]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "call 1: group None differs from group \"g\" of its rollout \"a\"; \
             pass the rollout records the calls were read with"
        );
        // Without a record, the rollout's first call sets its group.
        let calls = [
            call("a", None, &[1], &[2]),
            call("a", Some("h"), &[1], &[2]),
        ];
        let err = CallIndex::new(&[], &calls, &[0, 0]).unwrap_err();
        assert!(matches!(err, CoreError::InvalidCall { index: 1, .. }));
        assert!(err
            .to_string()
            .contains("group \"h\" differs from group None"));
    }

    #[test]
    fn spans_tile_the_sample_arrays_and_name_their_rollout() {
        // Rollout b (listed second, first seen first) branches into two samples.
        let calls = [
            call("b", None, &[1, 2], &[3]),
            call("a", None, &[5], &[6]),
            call("b", None, &[1, 4], &[7, 8]),
        ];
        let given = [
            RolloutKey {
                rollout_id: "a",
                group: None,
            },
            RolloutKey {
                rollout_id: "b",
                group: None,
            },
        ];
        let index = CallIndex::new(&given, &calls, &[0, 0, 0]).unwrap();
        let p = plan(&calls, None).unwrap();
        let spans: Vec<_> = index.spans(&p, &calls).collect();
        let got: Vec<_> = spans
            .iter()
            .map(|s| (s.info.rollout_id, s.start, s.info.len, s.rollout))
            .collect();
        assert_eq!(got, vec![("b", 0, 3, 1), ("b", 3, 4, 1), ("a", 7, 2, 0)]);
        assert_eq!(
            spans.iter().map(|s| s.info.len).sum::<usize>(),
            p.stats.sample_tokens
        );
    }

    #[test]
    fn versions_follow_the_generating_call() {
        let calls = [call("a", None, &[1], &[2]), call("b", None, &[1], &[3])];
        let index = CallIndex::new(&[], &calls, &[4, 9]).unwrap();
        assert_eq!(index.versions_of(&[-1, 0, 1, 1, -1]), vec![-1, 4, 9, 9, -1]);
        assert_eq!(index.versions_of(&[]), Vec::<i64>::new());
    }

    /// Each token's origin computed the obvious way: walk its generator list
    /// and its tree.
    fn reference_origin(t: &PackedTree, index: &CallIndex) -> (Vec<i32>, Vec<i32>, Vec<i64>) {
        let (mut rollout, mut group, mut version) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..t.tokens.len() {
            let (a, b) = (t.gen_offsets[i] as usize, t.gen_offsets[i + 1] as usize);
            if a < b {
                let c = t.gen_call[a] as usize;
                rollout.push(index.rollout[c]);
                version.push(index.version[c]);
            } else {
                rollout.push(-1);
                version.push(-1);
            }
            let tree = (0..t.tree_keys.len())
                .find(|&k| t.tree_offsets[k] <= i as i64 && (i as i64) < t.tree_offsets[k + 1])
                .unwrap();
            group.push(index.group[t.tree_call[tree] as usize]);
        }
        (rollout, group, version)
    }

    #[test]
    fn packed_origin_matches_the_reference_per_rollout_and_across() {
        let calls = [
            call("a", Some("g"), &[1, 2, 3], &[4]),
            call("b", Some("g"), &[1, 2, 3], &[5, 6]),
            call("a", Some("g"), &[1, 2, 3, 4, 9], &[7]),
            call("c", None, &[1, 2], &[8]),
        ];
        let given = [RolloutKey {
            rollout_id: "idle",
            group: Some("h"),
        }];
        let index = CallIndex::new(&given, &calls, &[1, 2, 3, 4]).unwrap();
        let p = plan(&calls, None).unwrap();
        for across in [false, true] {
            let (t, o) = index.pack(&p, &calls, None, across, &Fresh).unwrap();
            let (rollout, group, version) = reference_origin(&t, &index);
            assert_eq!(
                (o.rollout, o.group, o.weight_version),
                (rollout, group, version)
            );
            assert_eq!(o.call_rollout, vec![1, 2, 1, 3]);
            assert_eq!(o.groups, vec!["h", "g"]);
            let trees = if across {
                vec!["g", "c"]
            } else {
                vec!["a", "b", "c"]
            };
            assert_eq!(t.tree_keys, trees);
        }
    }

    #[test]
    fn plain_sequences_have_no_origin() {
        let o = TokenOrigin::none(3);
        assert_eq!(
            (o.rollout, o.group, o.weight_version),
            (vec![-1; 3], vec![-1; 3], vec![-1; 3])
        );
        assert!(o.call_rollout.is_empty() && o.groups.is_empty());
    }
}
