//! Chat rendering, token-exact chat encoding, per-message spans and splicing.
//!
//! `encode_chat` in parity mode equals `apply_chat_template(tokenize=True)`:
//! literal control-token text inside message content becomes the control token,
//! as it did for the engine. With `protect_content`, control-token text in
//! anything the caller supplies (message fields, tool specs, template
//! variables) is encoded as plain text, while the template's own markup still
//! becomes control tokens: the ids equal transformers' `apply_chat_template(...,
//! tokenize=True, sanitize_control_tokens=True)`. Like transformers, we wrap
//! each control token in the input in private-use markers, render, and encode
//! the render piece by piece between the markers.
//!
//! `splice` builds a prompt whose assistant turns reuse the exact ids an earlier
//! call generated, wherever the generated text appears verbatim in the render,
//! so the next prompt extends the previous call's prompt + completion and the
//! trie collapses the calls into one sample.

use aho_corasick::AhoCorasick;
use serde_json::{Map, Value as Json};

use crate::error::CoreError;
use crate::template::RenderInput;
use crate::tokenizer::{Piece, Tokenizer};

/// Options of one chat render.
#[derive(Debug, Clone, Default)]
pub struct ChatInput<'a> {
    pub messages: &'a [Json],
    pub tools: Option<&'a Json>,
    pub add_generation_prompt: bool,
    /// Extra template variables (e.g. `enable_thinking`), as keyword arguments.
    pub kwargs: Map<String, Json>,
}

/// Where one message sits in the rendered text and in the ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageSpan {
    pub index: usize,
    pub role: String,
    pub byte_start: usize,
    pub byte_end: usize,
    pub token_start: usize,
    pub token_end: usize,
}

/// An earlier call of the rollout: the ids it generated.
#[derive(Debug, Clone)]
pub struct Generation {
    pub completion_ids: Vec<u32>,
}

/// One region of the prompt that reuses a generation's ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplicedSpan {
    pub generation: usize,
    pub byte_start: usize,
    pub byte_end: usize,
    pub token_start: usize,
    pub token_end: usize,
    /// Whether plain tokenization of the same text would have given other ids
    /// (the drift that splicing prevented).
    pub plain_differs: bool,
}

#[derive(Debug, Clone)]
pub struct SpliceResult {
    pub ids: Vec<u32>,
    pub text: String,
    pub spliced: Vec<SplicedSpan>,
    /// Generations whose text was not found verbatim in the render (the
    /// template rewrote them: stripped reasoning, re-serialized tool calls, ...).
    pub unmatched: Vec<usize>,
}

/// (message index, byte start, byte end) of one content in a render.
pub type ContentRange = (usize, usize, usize);

// Private-use code points: no template transforms them and real content
// practically never holds them (content that does skips the marker pass).
const MARK_OPEN: char = '\u{F0000}';
const MARK_CLOSE: char = '\u{F0001}';

/// Where a protected render is cut (byte offsets into its marker-free text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// A control token's text that came from the input: encoded alone, as text.
    Text(usize, usize),
    /// A marker the template separated from its token (e.g. by `split()`):
    /// dropped, but the text on either side is encoded apart, so it cannot
    /// join into a control token.
    Break(usize),
}

/// Wrap each control token in every string of `v` (values, not keys) in
/// markers, after removing markers already there so input cannot forge one.
fn mark_json(v: &Json, ac: Option<&AhoCorasick>) -> Json {
    match v {
        Json::String(s) => {
            let s: String = s
                .chars()
                .filter(|&c| c != MARK_OPEN && c != MARK_CLOSE)
                .collect();
            let Some(ac) = ac else {
                return Json::String(s);
            };
            let mut out = String::with_capacity(s.len() + 8);
            let mut at = 0;
            for m in ac.find_iter(&s) {
                out.push_str(&s[at..m.start()]);
                out.push(MARK_OPEN);
                out.push_str(&s[m.start()..m.end()]);
                out.push(MARK_CLOSE);
                at = m.end();
            }
            out.push_str(&s[at..]);
            Json::String(out)
        }
        Json::Array(items) => Json::Array(items.iter().map(|x| mark_json(x, ac)).collect()),
        Json::Object(m) => Json::Object(
            m.iter()
                .map(|(k, x)| (k.clone(), mark_json(x, ac)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Cuts inside [a, b), shifted to start at a.
fn cuts_within(cuts: &[Cut], a: usize, b: usize) -> Vec<Cut> {
    cuts.iter()
        .filter_map(|&c| match c {
            Cut::Text(s, e) if a <= s && e <= b => Some(Cut::Text(s - a, e - a)),
            Cut::Break(p) if a < p && p < b => Some(Cut::Break(p - a)),
            _ => None,
        })
        .collect()
}

/// Whether [a, b) overlaps a control token without containing it whole.
fn cuts_any(controls: &[(usize, usize)], a: usize, b: usize) -> bool {
    controls
        .iter()
        .any(|&(s, e)| s < b && a < e && !(a <= s && e <= b))
}

/// The byte window each assistant message can occupy: from the end of the
/// last content of an earlier message to the start of the first content of a
/// later one (the turn's own markup and content lie in between).
fn assistant_windows(
    messages: &[Json],
    located: &[ContentRange],
    len: usize,
) -> Vec<(usize, usize)> {
    messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.get("role").and_then(Json::as_str) == Some("assistant"))
        .map(|(k, _)| {
            let start = located
                .iter()
                .filter(|r| r.0 < k)
                .map(|r| r.2)
                .max()
                .unwrap_or(0);
            let end = located
                .iter()
                .filter(|r| r.0 > k)
                .map(|r| r.1)
                .min()
                .unwrap_or(len);
            (start, end.max(start))
        })
        .collect()
}

/// The string contents of a message (plain string or text parts).
fn contents(msg: &Json) -> Vec<&str> {
    match msg.get("content") {
        Some(Json::String(s)) => vec![s.as_str()],
        Some(Json::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Json::as_str))
            .collect(),
        _ => Vec::new(),
    }
}

impl Tokenizer {
    fn render_input<'a>(&self, chat: &ChatInput<'a>, messages: &'a [Json]) -> RenderInput<'a> {
        let cfg = self.config();
        let mut vars = Map::new();
        for (k, v) in [
            ("bos_token", &cfg.bos_token),
            ("eos_token", &cfg.eos_token),
            ("unk_token", &cfg.unk_token),
            ("pad_token", &cfg.pad_token),
        ] {
            if let Some(v) = v {
                vars.insert(k.into(), Json::String(v.clone()));
            }
        }
        for (k, v) in &chat.kwargs {
            vars.insert(k.clone(), v.clone());
        }
        RenderInput {
            messages,
            tools: chat.tools,
            add_generation_prompt: chat.add_generation_prompt,
            vars,
        }
    }

    /// Render like `apply_chat_template(..., tokenize=False)`.
    pub fn render_chat(&self, chat: &ChatInput<'_>) -> Result<String, CoreError> {
        let t = self.template().ok_or(CoreError::NoTemplate)?;
        t.render(&self.render_input(chat, chat.messages))
    }

    /// Where each message's non-empty content lands in the render `text` of
    /// `chat`, as (message index, start, end), in text order.
    ///
    /// Exact when the template copies content verbatim or trimmed: the
    /// conversation is rendered again with every content replaced by a unique
    /// marker, and the markers are put back; if that reproduces `text`, the
    /// markers' places are the contents' places. Templates that transform
    /// content otherwise (splitting off `</think>`) fail that check, and then each content is
    /// searched in order, skipping matches that would cut through a control
    /// token of the template's markup (a content "|" inside `<|im_end|>`).
    pub fn locate_contents(&self, chat: &ChatInput<'_>, text: &str) -> Vec<ContentRange> {
        self.locate_by_markers(chat, text)
            .unwrap_or_else(|| self.locate_by_search(chat.messages, text))
    }

    fn locate_by_markers(&self, chat: &ChatInput<'_>, text: &str) -> Option<Vec<ContentRange>> {
        let mut marked: Vec<Json> = chat.messages.to_vec();
        // (message, content) for each marker, in marker-number order.
        let mut originals: Vec<(usize, &str)> = Vec::new();
        for (i, m) in chat.messages.iter().enumerate() {
            for c in contents(m) {
                if c.contains(MARK_OPEN) || c.contains(MARK_CLOSE) {
                    return None; // content that looks like a marker: do not guess.
                }
                if !c.is_empty() {
                    originals.push((i, c));
                }
            }
        }
        if originals.is_empty() {
            return Some(Vec::new());
        }
        let mut k = 0;
        for m in marked.iter_mut() {
            let mark = |s: &mut String, k: &mut usize| {
                if !s.is_empty() {
                    *s = format!("{MARK_OPEN}{k}{MARK_CLOSE}");
                    *k += 1;
                }
            };
            match m.get_mut("content") {
                Some(Json::String(s)) => mark(s, &mut k),
                Some(Json::Array(parts)) => {
                    for p in parts.iter_mut() {
                        if let Some(Json::String(s)) = p.get_mut("text") {
                            mark(s, &mut k);
                        }
                    }
                }
                _ => {}
            }
        }
        let t = self.template()?;
        let rendered = t.render(&self.render_input(chat, &marked)).ok()?;
        // Walk the real render along the marked one: the text between markers
        // must agree exactly, and each marker stands for its content as is or
        // trimmed (`| trim`, `.strip()` are what templates do to content).
        let mut out = Vec::new();
        let mut pos = 0;
        let mut rest = rendered.as_str();
        let literal = |rest: &str| rest.find(MARK_OPEN).map_or(rest.len(), |i| i);
        let lit = &rest[..literal(rest)];
        if !text.starts_with(lit) {
            return None;
        }
        pos += lit.len();
        rest = &rest[lit.len()..];
        while !rest.is_empty() {
            let after = &rest[MARK_OPEN.len_utf8()..];
            let close = after.find(MARK_CLOSE)?;
            let n: usize = after[..close].parse().ok()?;
            let (msg, c) = *originals.get(n)?;
            rest = &after[close + MARK_CLOSE.len_utf8()..];
            let lit = &rest[..literal(rest)];
            let cand = [c, c.trim(), c.trim_start(), c.trim_end()]
                .into_iter()
                .find(|cand| {
                    text[pos..].starts_with(cand) && text[pos + cand.len()..].starts_with(lit)
                })?;
            if !cand.is_empty() {
                out.push((msg, pos, pos + cand.len()));
            }
            pos += cand.len() + lit.len();
            rest = &rest[lit.len()..];
        }
        (pos == text.len()).then_some(out)
    }

    fn locate_by_search(&self, messages: &[Json], text: &str) -> Vec<ContentRange> {
        let controls = self.control_ranges(text);
        let mut out = Vec::new();
        let mut at = 0;
        for (i, m) in messages.iter().enumerate() {
            for c in contents(m) {
                if c.is_empty() {
                    continue;
                }
                let hit = text[at..]
                    .match_indices(c)
                    .map(|(p, _)| (at + p, at + p + c.len()))
                    .find(|&(a, b)| !cuts_any(&controls, a, b));
                if let Some((a, b)) = hit {
                    out.push((i, a, b));
                    at = b;
                }
            }
        }
        out
    }

    /// Byte ranges of the added tokens the encoder would split out of `text`.
    fn control_ranges(&self, text: &str) -> Vec<(usize, usize)> {
        self.pieces(text)
            .into_iter()
            .filter_map(|p| match p {
                Piece::Added { start, end, .. } => Some((start, end)),
                Piece::Text(..) => None,
            })
            .collect()
    }

    /// Render and encode like `apply_chat_template(..., tokenize=True)`, or
    /// with `protect_content` so content cannot inject control tokens.
    pub fn encode_chat(
        &self,
        chat: &ChatInput<'_>,
        protect_content: bool,
    ) -> Result<(String, Vec<u32>), CoreError> {
        if protect_content {
            let (text, cuts) = self.protected_render(chat)?;
            let ids = self.encode_cut(&text, &cuts)?;
            return Ok((text, ids));
        }
        let text = self.render_chat(chat)?;
        let ids = self.encode_segments(&text, true)?;
        Ok((text, ids))
    }

    /// Render with every control token of the input wrapped in markers, then
    /// take the markers out: the text and where it must be cut. A marker pair
    /// around an added token is that token's text, kept as text; any other
    /// marker only breaks the text.
    pub fn protected_render(&self, chat: &ChatInput<'_>) -> Result<(String, Vec<Cut>), CoreError> {
        let ac = self.control_matcher()?;
        let messages: Vec<Json> = chat.messages.iter().map(|m| mark_json(m, ac)).collect();
        let tools = chat.tools.map(|t| mark_json(t, ac));
        let kwargs: Map<String, Json> = chat
            .kwargs
            .iter()
            .map(|(k, v)| (k.clone(), mark_json(v, ac)))
            .collect();
        let marked = ChatInput {
            messages: &messages,
            tools: tools.as_ref(),
            add_generation_prompt: chat.add_generation_prompt,
            kwargs,
        };
        let rendered = self.render_chat(&marked)?;
        let added = self.added_token_texts();
        let mut text = String::with_capacity(rendered.len());
        let mut cuts = Vec::new();
        let mut rest = rendered.as_str();
        while let Some(i) = rest.find([MARK_OPEN, MARK_CLOSE]) {
            text.push_str(&rest[..i]);
            let after = &rest[i + MARK_OPEN.len_utf8()..];
            let wrapped = rest[i..]
                .starts_with(MARK_OPEN)
                .then(|| {
                    added.iter().find(|t| {
                        after.starts_with(t.as_str()) && after[t.len()..].starts_with(MARK_CLOSE)
                    })
                })
                .flatten();
            match wrapped {
                Some(t) => {
                    cuts.push(Cut::Text(text.len(), text.len() + t.len()));
                    text.push_str(t);
                    rest = &after[t.len() + MARK_CLOSE.len_utf8()..];
                }
                None => {
                    cuts.push(Cut::Break(text.len()));
                    rest = after; // both markers are 4 bytes long
                }
            }
        }
        text.push_str(rest);
        Ok((text, cuts))
    }

    /// Encode a protected render piece by piece, as transformers'
    /// `encode_marked_chat` does: the text before the first cut as usual;
    /// every later piece after a newline that is then taken off again (so a
    /// SentencePiece tokenizer adds no word-start space); a protected token's
    /// text without added-token splitting, and an error if that still yields
    /// the control token.
    pub fn encode_cut(&self, text: &str, cuts: &[Cut]) -> Result<Vec<u32>, CoreError> {
        let newline = self.encode_segments("\n", true)?;
        let mut out: Vec<u32> = Vec::with_capacity(text.len() / 3);
        let piece = |a: usize, b: usize, as_text: bool, first: bool, out: &mut Vec<u32>| {
            let p = &text[a..b];
            if first {
                out.extend(self.encode_segments(p, true)?);
                return Ok::<(), CoreError>(());
            }
            if p.is_empty() {
                return Ok(());
            }
            let enc = |s: &str| {
                if as_text {
                    self.encode_text_only(s)
                } else {
                    self.encode_segments(s, true)
                }
            };
            let with_nl = enc(&format!("\n{p}"))?;
            let ids = match with_nl.strip_prefix(newline.as_slice()) {
                Some(rest) => rest.to_vec(),
                None => enc(p)?,
            };
            if as_text && self.token_to_id(p).is_some_and(|id| ids.contains(&id)) {
                return Err(CoreError::Tokenize(format!(
                    "cannot protect {p:?}: this tokenizer produces it from plain text too"
                )));
            }
            out.extend(ids);
            Ok(())
        };
        let mut at = 0;
        let mut first = true;
        for &c in cuts {
            match c {
                Cut::Text(a, b) => {
                    piece(at, a, false, first, &mut out)?;
                    piece(a, b, true, false, &mut out)?;
                    at = b;
                }
                Cut::Break(p) => {
                    piece(at, p, false, first, &mut out)?;
                    at = p;
                }
            }
            first = false;
        }
        piece(at, text.len(), false, first, &mut out)?;
        Ok(out)
    }

    /// How many control tokens the messages' content would inject in parity mode.
    pub fn content_control_tokens(&self, messages: &[Json]) -> usize {
        messages
            .iter()
            .flat_map(contents)
            .map(|c| self.count_control_tokens(c))
            .sum()
    }

    /// Per-message spans. Message i ends where the render of messages[..=i]
    /// stops agreeing with the full render; a trailing generation prompt
    /// belongs to no message. Tokens belong to the span their first byte is in.
    pub fn chat_spans(
        &self,
        chat: &ChatInput<'_>,
    ) -> Result<(String, Vec<u32>, Vec<MessageSpan>), CoreError> {
        let t = self.template().ok_or(CoreError::NoTemplate)?;
        let full = self.render_chat(chat)?;
        let n = chat.messages.len();
        let mut ends = Vec::with_capacity(n);
        let mut prev = 0;
        for i in 0..n {
            let mut sub = chat.clone();
            sub.add_generation_prompt = false;
            let end = if i + 1 == n && !chat.add_generation_prompt {
                full.len()
            } else {
                match t.render(&self.render_input(&sub, &chat.messages[..=i])) {
                    Ok(part) => {
                        let common = part
                            .bytes()
                            .zip(full.bytes())
                            .take_while(|(a, b)| a == b)
                            .count();
                        let mut c = common;
                        while !full.is_char_boundary(c) {
                            c -= 1;
                        }
                        c.max(prev)
                    }
                    Err(_) => prev,
                }
            };
            ends.push(end);
            prev = end;
        }
        let ids = self.encode_segments(&full, true)?;
        // Byte start of each token: walk the pieces again with offsets.
        let offsets = self.offsets(&full)?;
        let starts: Vec<usize> = if offsets.len() == ids.len() {
            offsets.iter().map(|o| o.0).collect()
        } else {
            Vec::new()
        };
        let mut spans = Vec::with_capacity(n);
        let mut start = 0;
        for (i, &end) in ends.iter().enumerate() {
            let tok = |b: usize| starts.iter().take_while(|&&s| s < b).count();
            let role = chat.messages[i]
                .get("role")
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_owned();
            spans.push(MessageSpan {
                index: i,
                role,
                byte_start: start,
                byte_end: end,
                token_start: tok(start),
                token_end: tok(end),
            });
            start = end;
        }
        Ok((full, ids, spans))
    }

    /// Build prompt ids that reuse earlier generations' exact ids (see module docs).
    pub fn splice(
        &self,
        chat: &ChatInput<'_>,
        generations: &[Generation],
        protect_content: bool,
    ) -> Result<SpliceResult, CoreError> {
        let (text, cuts) = if protect_content {
            self.protected_render(chat)?
        } else {
            (self.render_chat(chat)?, Vec::new())
        };
        let located = self.locate_contents(chat, &text);
        // Added-token text, the template's or protected input's alike, is a
        // boundary a generation may contain whole but never cut.
        let controls = self.control_ranges(&text);
        let windows = assistant_windows(chat.messages, &located, text.len());
        // Locate each generation's text (with, else without, trailing control
        // tokens) inside an assistant turn, never cutting through a control
        // token: a generation "0" must not match the end of a user's "q0".
        let mut regions: Vec<(usize, usize, usize, Vec<u32>)> = Vec::new(); // start, end, gen, ids
        let mut unmatched = Vec::new();
        let mut at = 0;
        for (g, gen) in generations.iter().enumerate() {
            let mut ids = gen.completion_ids.clone();
            let mut found = None;
            loop {
                if ids.is_empty() {
                    break;
                }
                let s = self.decode(&ids, false)?;
                if !s.is_empty() {
                    found = text[at..]
                        .match_indices(s.as_str())
                        .map(|(p, _)| (at + p, at + p + s.len()))
                        .find(|&(a, b)| {
                            !cuts_any(&controls, a, b)
                                && windows.iter().any(|&(ws, we)| ws <= a && b <= we)
                        });
                    if found.is_some() {
                        break;
                    }
                }
                match ids.last() {
                    Some(&last) if self.is_special(last) => {
                        ids.pop();
                    }
                    _ => break,
                }
            }
            match found {
                Some((a, b)) => {
                    regions.push((a, b, g, ids));
                    at = b;
                }
                None => unmatched.push(g),
            }
        }
        let mut out: Vec<u32> = Vec::with_capacity(text.len() / 3);
        let mut spliced = Vec::new();
        let mut cursor = 0;
        for (a, b, g, ids) in regions {
            out.extend(self.encode_cut(&text[cursor..a], &cuts_within(&cuts, cursor, a))?);
            let token_start = out.len();
            out.extend_from_slice(&ids);
            // Plain tokenization of the same prefix, for the drift report.
            let plain = self.encode_segments(&text[..b], true)?;
            let mut ours = self.encode_segments(&text[..a], true)?;
            ours.extend_from_slice(&ids);
            let plain_differs = plain != ours;
            spliced.push(SplicedSpan {
                generation: g,
                byte_start: a,
                byte_end: b,
                token_start,
                token_end: out.len(),
                plain_differs,
            });
            cursor = b;
        }
        out.extend(self.encode_cut(&text[cursor..], &cuts_within(&cuts, cursor, text.len()))?);
        Ok(SpliceResult {
            ids: out,
            text,
            spliced,
            unmatched,
        })
    }
}
