//! Chat rendering, token-exact chat encoding, per-message spans and splicing.
//!
//! `encode_chat` in parity mode equals `apply_chat_template(tokenize=True)`:
//! literal control-token text inside message content becomes the control token,
//! as it did for the engine. With `protect_content`, the byte ranges where each
//! message's content lands in the render are encoded as text only, while the
//! template's own markup still becomes control tokens.
//!
//! `splice` builds a prompt whose assistant turns reuse the exact ids an earlier
//! call generated, wherever the generated text appears verbatim in the render,
//! so the next prompt extends the previous call's prompt + completion and the
//! trie collapses the calls into one sample.

use serde_json::{Map, Value as Json};

use crate::error::CoreError;
use crate::template::RenderInput;
use crate::tokenizer::Tokenizer;

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

    /// Byte ranges of message contents in `text`, found in order.
    pub fn content_ranges(&self, messages: &[Json], text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut at = 0;
        for m in messages {
            for c in contents(m) {
                if c.is_empty() {
                    continue;
                }
                if let Some(pos) = text[at..].find(c) {
                    out.push((at + pos, at + pos + c.len()));
                    at += pos + c.len();
                }
            }
        }
        out
    }

    /// Render and encode like `apply_chat_template(..., tokenize=True)`, or
    /// with `protect_content` so content cannot inject control tokens.
    pub fn encode_chat(
        &self,
        chat: &ChatInput<'_>,
        protect_content: bool,
    ) -> Result<(String, Vec<u32>), CoreError> {
        let text = self.render_chat(chat)?;
        let protected = if protect_content {
            self.content_ranges(chat.messages, &text)
        } else {
            Vec::new()
        };
        let ids = self.encode_segments(&text, &protected, true)?;
        Ok((text, ids))
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
        let ids = self.encode_segments(&full, &[], true)?;
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
        let text = self.render_chat(chat)?;
        // Locate each generation's text (with, else without, trailing control tokens).
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
                    if let Some(pos) = text[at..].find(&s) {
                        found = Some((at + pos, at + pos + s.len()));
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
        let protected = if protect_content {
            self.content_ranges(chat.messages, &text)
        } else {
            Vec::new()
        };
        // Content ranges that overlap a spliced region are the generation itself.
        let protected_outside = |a: usize, b: usize| -> Vec<(usize, usize)> {
            protected
                .iter()
                .filter(|&&(s, e)| s < b && a < e)
                .map(|&(s, e)| (s.max(a) - a, e.min(b) - a))
                .collect()
        };
        let mut out: Vec<u32> = Vec::with_capacity(text.len() / 3);
        let mut spliced = Vec::new();
        let mut cursor = 0;
        for (a, b, g, ids) in regions {
            out.extend(self.encode_segments(
                &text[cursor..a],
                &protected_outside(cursor, a),
                true,
            )?);
            let token_start = out.len();
            out.extend_from_slice(&ids);
            // Plain tokenization of the same prefix, for the drift report.
            let plain = self.encode_segments(&text[..b], &[], true)?;
            let mut ours = self.encode_segments(&text[..a], &[], true)?;
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
        out.extend(self.encode_segments(
            &text[cursor..],
            &protected_outside(cursor, text.len()),
            true,
        )?);
        Ok(SpliceResult {
            ids: out,
            text,
            spliced,
            unmatched,
        })
    }
}
