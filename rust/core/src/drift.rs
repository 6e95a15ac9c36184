//! Drift classification: why a later prompt left the earlier context.
//!
//! Given the previous context ids (an earlier call's prompt + completion) and
//! the next prompt ids, find the first position where they differ and name the
//! cause. Checks run from the most specific to the least:
//! 1. `match`: the next prompt extends the previous context.
//! 2. `retokenization`: decoded texts agree (the previous text is a prefix of
//!    the next), only the ids differ.
//! 3. `reasoning_stripped`: the previous text has a `<think>…</think>` block
//!    after the divergence and, with it removed, the texts agree up to
//!    whitespace.
//! 4. `tool_call_reserialized`: the JSON objects (tool calls) after the
//!    divergence parse to equal values but their text differs.
//! 5. `truncated`: the previous context does not end in a control token (the
//!    completion was cut, e.g. no EOS) and the divergence lies in its last turn.
//! 6. `separator`: the texts agree once whitespace and control tokens are
//!    ignored (the template's scaffold between turns changed).
//! 7. `compacted`: most turns after the divergent one are absent from the next
//!    prompt: history summarized or dropped.
//! 8. `other`.

use serde_json::Value as Json;

use crate::error::CoreError;
use crate::tokenizer::{Piece, Tokenizer};
use crate::trace::{CallView, Divergence, DivergenceKind};

/// The verdict: kind, first differing token index, first differing byte of the
/// decoded texts, and a human-readable note.
#[derive(Debug, Clone)]
pub struct Drift {
    pub kind: DivergenceKind,
    pub position: usize,
    pub text_offset: usize,
    pub detail: String,
}

fn squeeze(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

/// Remove `<think>…</think>` blocks (an unclosed one runs to the end).
fn strip_think(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("<think>") {
        out.push_str(&rest[..i]);
        match rest[i..].find("</think>") {
            Some(j) => rest = &rest[i + j + "</think>".len()..],
            None => {
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// Every JSON object in `s` (scanning for `{` that starts a valid value), with
/// string `arguments` fields parsed so re-serialized arguments compare equal.
fn json_objects(s: &str) -> Vec<Json> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(off) = s[i..].find('{') {
        let at = i + off;
        let mut it = serde_json::Deserializer::from_str(&s[at..]).into_iter::<Json>();
        match it.next() {
            Some(Ok(v)) => {
                out.push(normalize_call(v));
                i = at + it.byte_offset().max(1);
            }
            _ => i = at + 1,
        }
    }
    out
}

fn normalize_call(mut v: Json) -> Json {
    if let Json::Object(m) = &mut v {
        for key in ["arguments", "parameters"] {
            if let Some(Json::String(s)) = m.get(key) {
                if let Ok(parsed) = serde_json::from_str::<Json>(s) {
                    m.insert(key.into(), parsed);
                }
            }
        }
        for (_, child) in m.iter_mut() {
            let taken = std::mem::take(child);
            *child = normalize_call(taken);
        }
    }
    v
}

fn char_lcp(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

/// Classify why `next` leaves `prev` (see module docs).
pub fn classify_drift(prev: &[u32], next: &[u32], tok: &Tokenizer) -> Result<Drift, CoreError> {
    let p = prev.iter().zip(next).take_while(|(a, b)| a == b).count();
    if p == prev.len() {
        return Ok(Drift {
            kind: DivergenceKind::Match,
            position: p,
            text_offset: 0,
            detail: "the next prompt extends the previous context".into(),
        });
    }
    let tp = tok.decode(prev, false)?;
    let tn = tok.decode(next, false)?;
    let c = char_lcp(&tp, &tn);
    let (a, b) = (&tp[c..], &tn[c..]);
    let id_note = format!(
        "token {p}: previous id {} vs next id {}",
        prev[p],
        next.get(p)
            .map_or_else(|| "<end>".to_owned(), u32::to_string)
    );
    let verdict = |kind: DivergenceKind, detail: String| Drift {
        kind,
        position: p,
        text_offset: c,
        detail,
    };

    if a.is_empty() {
        return Ok(verdict(
            DivergenceKind::Retokenization,
            format!("decoded texts agree but ids differ at {id_note} (text byte {c})"),
        ));
    }

    // Start of the turn the divergence is in: just after the last control token
    // of the common text.
    let turn_start = tok
        .pieces(&tp)
        .iter()
        .rev()
        .find_map(|pc| match *pc {
            Piece::Added { end, .. } if end <= c => Some(end),
            _ => None,
        })
        .unwrap_or(0);
    let (ta, tb) = (&tp[turn_start..], &tn[turn_start..]);

    // Reasoning: a think block in the previous turn that the next one lacks.
    let think_open = ta.find("<think>").or_else(|| ta.find("</think>"));
    if think_open.is_some() {
        let stripped = if ta.contains("<think>") {
            strip_think(ta)
        } else {
            // The opening tag was in the prompt: everything up to `</think>` is reasoning.
            ta.split_once("</think>")
                .map(|(_, r)| r.to_owned())
                .unwrap_or_default()
        };
        let (x, y) = (squeeze(&stripped), squeeze(tb));
        let next_has_reasoning = tb.contains("</think>");
        if !next_has_reasoning && (y.starts_with(&x) || x.starts_with(&y)) {
            return Ok(verdict(
                DivergenceKind::ReasoningStripped,
                format!("the template removed a <think> block from the previous turn ({id_note})"),
            ));
        }
    }

    // Tool calls: same JSON values, different text.
    let (ja, jb) = (json_objects(ta), json_objects(tb));
    if !ja.is_empty() && jb.len() >= ja.len() && ja[..] == jb[..ja.len()] {
        return Ok(verdict(
            DivergenceKind::ToolCallReserialized,
            format!(
                "{} tool call(s) came back with equal JSON but different text ({id_note})",
                ja.len()
            ),
        ));
    }

    let ends_in_control = prev.last().is_some_and(|&id| tok.is_special(id));
    if !ends_in_control {
        let last_turn = tok
            .pieces(&tp)
            .iter()
            .rev()
            .find_map(|pc| match *pc {
                Piece::Added { end, .. } => Some(end),
                _ => None,
            })
            .unwrap_or(0);
        if c >= last_turn {
            return Ok(verdict(
                DivergenceKind::Truncated,
                format!("the previous context ends without a control token (cut completion) and the next prompt rewrites its tail ({id_note})"),
            ));
        }
    }

    let skel = |s: &str| -> String {
        let mut t = s.to_owned();
        for pc in tok.pieces(s).iter().rev() {
            if let Piece::Added { start, end, .. } = *pc {
                t.replace_range(start..end, "");
            }
        }
        squeeze(&t)
    };
    let (sa, sb) = (skel(ta), skel(tb));
    if sb.starts_with(&sa) {
        return Ok(verdict(
            DivergenceKind::Separator,
            format!("only whitespace or control tokens between turns changed ({id_note})"),
        ));
    }

    // Compacted: the turns after the divergent one are gone from the next prompt.
    let later: Vec<String> = {
        let pcs = tok.pieces(a);
        let first = pcs.iter().position(|pc| matches!(pc, Piece::Added { .. }));
        pcs.iter()
            .skip(first.map_or(pcs.len(), |f| f + 1))
            .filter_map(|pc| match *pc {
                Piece::Text(s, e) => Some(squeeze(&a[s..e])),
                _ => None,
            })
            .filter(|s| s.chars().count() >= 4)
            .collect()
    };
    let sb_all = squeeze(b);
    let present = later.iter().filter(|s| sb_all.contains(s.as_str())).count();
    if !later.is_empty() && present * 2 < later.len() {
        return Ok(verdict(
            DivergenceKind::Compacted,
            format!(
                "{} of {} later turns of the previous context are absent from the next prompt: history dropped or summarized ({id_note})",
                later.len() - present,
                later.len()
            ),
        ));
    }
    Ok(verdict(
        DivergenceKind::Other,
        format!("texts differ at byte {c} ({id_note})"),
    ))
}

/// Name the cause of every divergence of a merge over `calls`: the previous
/// context is the left call's prompt + completion, the next is the diverging
/// call's prompt.
pub fn classify_divergences(
    calls: &[CallView<'_>],
    divergences: &mut [Divergence],
    tok: &Tokenizer,
) -> Result<(), CoreError> {
    for d in divergences {
        let left = calls[d.left_call_index];
        let mut prev = Vec::with_capacity(left.len());
        prev.extend_from_slice(left.prompt);
        prev.extend_from_slice(left.completion);
        d.kind = classify_drift(&prev, calls[d.call_index].prompt, tok)?.kind;
    }
    Ok(())
}
