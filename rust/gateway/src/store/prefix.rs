//! Prefix-shared call rows (store layout 2): a call stores only what it adds
//! to an earlier call of its rollout.
//!
//! A harness resends the whole conversation on every call, so call `n`'s
//! prompt is usually call `n-1`'s prompt + completion + a few new tokens, and
//! its request bodies are the previous ones with a few messages added. Stored
//! whole, a rollout costs the square of its length. Here a row may say:
//!
//! - **ids**: `prompt_base` = the seq of an earlier call of the same rollout,
//!   `prompt_shared` = how many leading tokens of that call's *prompt +
//!   completion* this prompt repeats; `prompt_ids` holds only the rest.
//! - **text**: `text_base` = the seq of an earlier call (a request's first
//!   choice, the row that holds its bodies); `request_head`/`request_tail` =
//!   bytes of that call's engine request this one starts/ends with,
//!   `request` holds the middle; likewise `harness_head`/`harness_tail` and
//!   `harness_request`. A JSON body with messages appended keeps its head
//!   (model, earlier messages) and its tail (the parameters after the list),
//!   so only the new messages are written, whatever the protocol.
//!
//! A `NULL` base means the column is stored whole (every row of layout 1).
//! Bases always name a lower seq of the same rollout, so reading a rollout's
//! calls in seq order resolves each row from rows already resolved: every
//! stored byte is read once (`Resolver`), never a chain per call.
//!
//! The writer picks bases from the last few calls of each rollout, kept in
//! memory (`Recent`): the candidate sharing the longest prefix wins. A miss
//! (a rollout the writer has not seen since it started, or one evicted under
//! the memory budget) stores the row whole, which is always correct.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The layout this gateway writes: `meta.schema_version`.
pub const SCHEMA_VERSION: i64 = 2;

/// Calls per rollout the writer remembers as candidate bases.
const PER_ROLLOUT: usize = 4;
/// Bytes of ids and text the writer keeps across all rollouts; above it, the
/// least recently written rollouts are forgotten (their next call is stored
/// whole, and the calls after it share again).
const BUDGET_BYTES: usize = 256 << 20;
/// A shorter shared prefix is not worth a reference.
const MIN_SHARED_IDS: usize = 8;
const MIN_SHARED_BYTES: usize = 64;

/// How a row's prompt ids are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdsRef {
    pub base: i64,
    pub shared: usize,
}

/// How a row's request bodies are stored: `base`'s head and tail bytes around
/// the stored middle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cut {
    pub head: usize,
    pub tail: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextRef {
    pub base: i64,
    pub request: Cut,
    pub harness: Cut,
}

#[derive(Debug)]
struct IdsEntry {
    seq: i64,
    /// Prompt + completion.
    full: Arc<[u32]>,
}

#[derive(Debug)]
struct TextEntry {
    seq: i64,
    request: Arc<str>,
    harness: Option<Arc<str>>,
}

#[derive(Debug, Default)]
struct Rollout {
    ids: VecDeque<IdsEntry>,
    texts: VecDeque<TextEntry>,
    used: u64,
}

impl Rollout {
    fn bytes(&self) -> usize {
        self.ids.iter().map(|e| e.full.len() * 4).sum::<usize>()
            + self
                .texts
                .iter()
                .map(|e| e.request.len() + e.harness.as_ref().map_or(0, |h| h.len()))
                .sum::<usize>()
    }
}

enum Staged {
    Ids(String, IdsEntry),
    Text(String, TextEntry),
}

/// The writer's memory of each rollout's latest calls. Rows written by an op
/// are staged until the op succeeds (`keep`) or rolls back (`discard`); a
/// failed commit forgets everything (`clear`), so a base is never a row that
/// did not reach the disk.
#[derive(Default)]
pub struct Recent {
    rollouts: HashMap<String, Rollout>,
    staged: Vec<Staged>,
    bytes: usize,
    tick: u64,
}

impl std::fmt::Debug for Recent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recent")
            .field("rollouts", &self.rollouts.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// Leading elements `a` and `b` share. Compared a block at a time (slice
/// equality is a memcmp), then element by element inside the first block
/// that differs: the writer runs this over whole conversations per call.
fn common_prefix<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    const BLOCK: usize = 256;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    i + a[i..n]
        .iter()
        .zip(&b[i..n])
        .take_while(|(x, y)| x == y)
        .count()
}

/// Trailing bytes `a` and `b` share, at most `room`.
fn common_suffix(a: &[u8], b: &[u8], room: usize) -> usize {
    const BLOCK: usize = 256;
    let (la, lb) = (a.len(), b.len());
    let mut i = 0;
    while i + BLOCK <= room && a[la - i - BLOCK..la - i] == b[lb - i - BLOCK..lb - i] {
        i += BLOCK;
    }
    i + a[..la - i]
        .iter()
        .rev()
        .zip(b[..lb - i].iter().rev())
        .take(room - i)
        .take_while(|(x, y)| x == y)
        .count()
}

/// The cut of `text` against `base`: common head and tail bytes, on char
/// boundaries, not overlapping in either string.
pub fn cut(text: &str, base: &str) -> Cut {
    let (t, b) = (text.as_bytes(), base.as_bytes());
    let mut head = common_prefix(t, b);
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    let room = t.len().min(b.len()) - head;
    let mut tail = common_suffix(t, b, room);
    while !text.is_char_boundary(t.len() - tail) {
        tail -= 1;
    }
    Cut { head, tail }
}

impl Recent {
    /// The base for a prompt: the remembered call of this rollout whose
    /// prompt + completion shares the longest prefix with it (the newest on a tie).
    pub fn ids_base(&self, rollout: &str, prompt: &[u32]) -> Option<IdsRef> {
        let mut best: Option<IdsRef> = None;
        let staged = self.staged.iter().rev().filter_map(|s| match s {
            Staged::Ids(r, e) if r == rollout => Some(e),
            _ => None,
        });
        let kept = self
            .rollouts
            .get(rollout)
            .into_iter()
            .flat_map(|r| r.ids.iter().rev());
        for e in staged.chain(kept) {
            let shared = common_prefix(prompt, &e.full);
            if shared >= MIN_SHARED_IDS && best.as_ref().is_none_or(|b| shared > b.shared) {
                best = Some(IdsRef {
                    base: e.seq,
                    shared,
                });
            }
            // Stop at the newest call this prompt wholly continues (the usual
            // next turn). An older, longer call shares more only when the
            // conversation went back to it; a few more stored tokens then,
            // and the writer compares one conversation per call, not four.
            if shared == e.full.len() && shared >= MIN_SHARED_IDS {
                break;
            }
        }
        best
    }

    /// The base for a request's bodies: the remembered call whose bodies share
    /// the most head and tail bytes with these.
    pub fn text_base(&self, rollout: &str, request: &str, harness: &str) -> Option<TextRef> {
        let mut best: Option<(usize, TextRef)> = None;
        let staged = self.staged.iter().rev().filter_map(|s| match s {
            Staged::Text(r, e) if r == rollout => Some(e),
            _ => None,
        });
        let kept = self
            .rollouts
            .get(rollout)
            .into_iter()
            .flat_map(|r| r.texts.iter().rev());
        for e in staged.chain(kept) {
            let rc = cut(request, &e.request);
            let hc = e
                .harness
                .as_deref()
                .map_or(Cut::default(), |h| cut(harness, h));
            let saved = rc.head + rc.tail + hc.head + hc.tail;
            if saved >= MIN_SHARED_BYTES && best.as_ref().is_none_or(|(s, _)| saved > *s) {
                best = Some((
                    saved,
                    TextRef {
                        base: e.seq,
                        request: rc,
                        harness: hc,
                    },
                ));
            }
        }
        best.map(|(_, r)| r)
    }

    /// Remembers a written row's prompt + completion (kept once its op succeeds).
    pub fn stage_ids(&mut self, rollout: &str, seq: i64, prompt: &[u32], completion: &[u32]) {
        let mut full = Vec::with_capacity(prompt.len() + completion.len());
        full.extend_from_slice(prompt);
        full.extend_from_slice(completion);
        self.staged.push(Staged::Ids(
            rollout.to_string(),
            IdsEntry {
                seq,
                full: full.into(),
            },
        ));
    }

    /// Remembers a written row's request bodies (kept once its op succeeds).
    pub fn stage_text(&mut self, rollout: &str, seq: i64, request: &str, harness: Option<&str>) {
        self.staged.push(Staged::Text(
            rollout.to_string(),
            TextEntry {
                seq,
                request: request.into(),
                harness: harness.map(Into::into),
            },
        ));
    }

    /// The op that staged rows succeeded: they become candidate bases.
    pub fn keep(&mut self) {
        self.tick += 1;
        for s in std::mem::take(&mut self.staged) {
            let (rollout, add) = match &s {
                Staged::Ids(r, e) => (r.clone(), e.full.len() * 4),
                Staged::Text(r, e) => (
                    r.clone(),
                    e.request.len() + e.harness.as_ref().map_or(0, |h| h.len()),
                ),
            };
            let slot = self.rollouts.entry(rollout).or_default();
            slot.used = self.tick;
            self.bytes += add;
            match s {
                Staged::Ids(_, e) => {
                    slot.ids.push_back(e);
                    if slot.ids.len() > PER_ROLLOUT {
                        if let Some(old) = slot.ids.pop_front() {
                            self.bytes -= old.full.len() * 4;
                        }
                    }
                }
                Staged::Text(_, e) => {
                    slot.texts.push_back(e);
                    if slot.texts.len() > PER_ROLLOUT {
                        if let Some(old) = slot.texts.pop_front() {
                            self.bytes -= old.request.len() + old.harness.map_or(0, |h| h.len());
                        }
                    }
                }
            }
        }
        self.evict();
    }

    /// The op that staged rows rolled back: forget them.
    pub fn discard(&mut self) {
        self.staged.clear();
    }

    /// The transaction did not commit: nothing remembered may be a base.
    pub fn clear(&mut self) {
        *self = Recent::default();
    }

    /// A rollout's calls were deleted: its rows can no longer be bases.
    pub fn forget(&mut self, rollout: &str) {
        if let Some(r) = self.rollouts.remove(rollout) {
            self.bytes -= r.bytes();
        }
    }

    fn evict(&mut self) {
        while self.bytes > BUDGET_BYTES {
            let Some(oldest) = self
                .rollouts
                .iter()
                .min_by_key(|(_, r)| r.used)
                .map(|(k, _)| k.clone())
            else {
                self.bytes = 0;
                return;
            };
            self.forget(&oldest);
        }
    }
}

/// Why a stored row cannot be resolved: the store file was damaged or
/// written by something other than this gateway.
#[derive(Debug)]
pub struct Damaged(pub String);

impl std::fmt::Display for Damaged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; the store file is damaged (restore it from a backup)",
            self.0
        )
    }
}

impl std::error::Error for Damaged {}

impl From<Damaged> for rusqlite::Error {
    fn from(d: Damaged) -> Self {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Blob, Box::new(d))
    }
}

/// A prompt rebuilt from its base's prompt and completion (already resolved)
/// and the stored suffix.
pub fn join_ids(
    base_prompt: &[u32],
    base_completion: &[u32],
    shared: usize,
    suffix: &[u32],
) -> Result<Vec<u32>, Damaged> {
    if shared > base_prompt.len() + base_completion.len() {
        return Err(Damaged(format!(
            "a call shares {shared} tokens of a call that has {}",
            base_prompt.len() + base_completion.len()
        )));
    }
    let mut out = Vec::with_capacity(shared + suffix.len());
    let p = shared.min(base_prompt.len());
    out.extend_from_slice(&base_prompt[..p]);
    out.extend_from_slice(&base_completion[..shared - p]);
    out.extend_from_slice(suffix);
    Ok(out)
}

/// A body rebuilt from its base's (already resolved) and the stored middle.
pub fn join_text(base: &str, c: Cut, middle: &str) -> Result<String, Damaged> {
    let ok = c.head.checked_add(c.tail).is_some_and(|n| n <= base.len())
        && base.is_char_boundary(c.head)
        && base.is_char_boundary(base.len() - c.tail);
    if !ok {
        return Err(Damaged(format!(
            "a request keeps {}+{} bytes of one that has {}",
            c.head,
            c.tail,
            base.len()
        )));
    }
    let mut out = String::with_capacity(c.head + middle.len() + c.tail);
    out.push_str(&base[..c.head]);
    out.push_str(middle);
    out.push_str(&base[base.len() - c.tail..]);
    Ok(out)
}

/// Seq → index of a rollout's rows read so far, in seq order.
#[derive(Debug, Default)]
pub struct Resolver {
    index: HashMap<i64, usize>,
}

impl Resolver {
    pub fn add(&mut self, seq: i64, idx: usize) {
        self.index.insert(seq, idx);
    }

    /// The index of an earlier row `seq` of this rollout.
    pub fn base(&self, seq: i64, of: i64) -> Result<usize, Damaged> {
        match self.index.get(&seq) {
            Some(&i) if seq < of => Ok(i),
            _ => Err(Damaged(format!(
                "call {of} refers to call {seq}, which is not an earlier call of its rollout"
            ))),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn cut_and_join_round_trip(
            head in "[a-cé€]{0,700}", x in "[a-cé€]{0,40}", y in "[a-cé€]{0,40}", tail in "[a-cé€]{0,700}",
        ) {
            // Long shared heads and tails, so the block compare runs too.
            let (text, base) = (format!("{head}{x}{tail}"), format!("{head}{y}{tail}"));
            let c = cut(&text, &base);
            prop_assert!(c.head >= head.len());
            prop_assert!(c.head + c.tail <= text.len().min(base.len()));
            let middle = &text[c.head..text.len() - c.tail];
            prop_assert_eq!(join_text(&base, c, middle).unwrap(), text);
        }

        #[test]
        fn ids_round_trip(p in proptest::collection::vec(0u32..4, 0..30),
                          c in proptest::collection::vec(0u32..4, 0..10),
                          next in proptest::collection::vec(0u32..4, 0..50)) {
            let mut full = p.clone();
            full.extend(&c);
            let shared = common_prefix(&next, &full);
            let got = join_ids(&p, &c, shared, &next[shared..]).unwrap();
            prop_assert_eq!(got, next);
        }
    }

    #[test]
    fn a_json_body_with_messages_appended_keeps_head_and_tail() {
        let a = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":9}"#;
        let b = r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}],"max_tokens":9}"#;
        let c = cut(b, a);
        assert_eq!(
            &b[c.head..b.len() - c.tail],
            r#",{"role":"assistant","content":"yo"}"#
        );
    }

    #[test]
    fn picks_the_longest_shared_prefix_and_forgets_on_failure() {
        let mut r = Recent::default();
        let a: Vec<u32> = (0..20).collect();
        let b: Vec<u32> = (0..10).chain(100..110).collect();
        r.stage_ids("x", 0, &a[..15], &a[15..]);
        r.stage_ids("x", 1, &b, &[]);
        r.keep();
        let next: Vec<u32> = (0..30).collect();
        assert_eq!(
            r.ids_base("x", &next),
            Some(IdsRef {
                base: 0,
                shared: 20
            })
        );
        assert_eq!(r.ids_base("y", &next), None);
        // Too short a prefix is no reference.
        assert_eq!(r.ids_base("x", &[0, 1, 2]), None);
        r.stage_ids("x", 2, &next, &[]);
        r.discard();
        assert_eq!(r.ids_base("x", &next).unwrap().base, 0);
        r.clear();
        assert_eq!(r.ids_base("x", &next), None);
    }

    #[test]
    fn damaged_references_are_errors() {
        assert!(join_ids(&[1, 2], &[3], 4, &[]).is_err());
        assert!(join_text("abc", Cut { head: 2, tail: 2 }, "").is_err());
        assert!(join_text("é", Cut { head: 1, tail: 0 }, "").is_err());
        let mut res = Resolver::default();
        res.add(0, 0);
        assert!(res.base(0, 1).is_ok());
        assert!(res.base(1, 1).is_err());
        assert!(res.base(5, 9).is_err());
    }
}
