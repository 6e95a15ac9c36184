//! Reading exact token ids and logprobs out of engine answers (pure functions
//! from bytes to values, so every parser can be fuzzed in isolation).
//!
//! Wire format sources (vLLM ≥ 0.10.2, `vllm/entrypoints/openai/protocol.py`,
//! request field `return_token_ids`: "In streaming mode, prompt_token_ids is
//! included only in the first chunk, and token_ids contains the delta tokens
//! for each chunk"):
//! - chat, non-streamed: `ChatCompletionResponse.prompt_token_ids` (top level),
//!   `ChatCompletionResponseChoice.token_ids`, `.logprobs.content[].logprob`
//!   (`ChatCompletionLogProbsContent`).
//! - chat, streamed: `ChatCompletionStreamResponse.prompt_token_ids` (first
//!   chunk), `ChatCompletionResponseStreamChoice.token_ids` (delta) and
//!   `.logprobs.content[]` (delta), `.finish_reason`; `usage` on the last chunk
//!   with `stream_options.include_usage`.
//! - completions (both): `CompletionResponseChoice.prompt_token_ids` and
//!   `.token_ids` per choice (stream: `CompletionResponseStreamChoice`, same
//!   names), logprobs as `CompletionLogProbs.token_logprobs: [float|null]`.
//!
//! SGLang: the reader also accepts a per-choice `prompt_token_ids` on chat
//! choices (seen in SGLang's `ChatCompletionResponseChoice` in forks that add
//! it) and `output_ids` in place of `token_ids`. The gateway speaks to SGLang
//! through these OpenAI endpoints only, never its native `/generate`. These
//! SGLang shapes were checked against source excerpts only, not a running
//! SGLang server.

use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::BTreeMap;

use super::lenient::{Leaf, List, Obj};
use super::sse::Event;

/// Whether the request was a chat or a plain completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Chat => "chat",
            Kind::Completion => "completion",
        }
    }
}

/// What one choice of one answer carried.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChoiceCapture {
    pub index: i64,
    /// Per-choice prompt ids (completions; for chat the top-level ones are used).
    pub prompt_ids: Option<Vec<u32>>,
    pub completion_ids: Option<Vec<u32>>,
    /// One entry per completion token; NaN where the engine sent null.
    pub logprobs: Option<Vec<f32>>,
    pub finish_reason: Option<String>,
    /// The choice's text (chat: message content; completions: text).
    pub text: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Capture {
    /// The answer's `id` (`chatcmpl-…`, `cmpl-…`): what the harness was told.
    pub id: Option<String>,
    pub prompt_ids: Option<Vec<u32>>,
    pub choices: Vec<ChoiceCapture>,
    pub usage: Option<serde_json::Value>,
}

/// One engine answer as JSON: a streamed chunk, or a whole answer (the same
/// fields, with `message` where a chunk has `delta`). Read once per chunk,
/// for the capture and for the stream's translator (`protocol`) alike.
///
/// The fields the capture records are strict: a value of another type makes
/// the chunk unreadable (an upstream error; the harness never sees it). The
/// fields only the translators read (`model`, `stop_reason`, a delta's
/// reasoning and tool calls) are lenient (`wire::lenient`): any value they
/// hold reads, so they cannot make the capture refuse a chunk. A key given
/// twice is refused in every field read here, lenient or not (serde's
/// derive), so the harness never sees a value the store read otherwise.
/// Fields are declared in the order they always had (a JSON list read as a
/// struct fills them in this order); the translators' fields come last.
#[derive(Debug, Deserialize, Default)]
#[serde(default)]
pub struct Chunk<'a> {
    pub id: Option<String>,
    /// The engine failed mid-stream (`null` reads as no error).
    pub error: Option<serde_json::Value>,
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(borrow)]
    pub choices: Vec<Choice<'a>>,
    pub usage: Option<serde_json::Value>,
    /// Left unread (only Messages' first chunk echoes it, as any JSON value).
    #[serde(borrow)]
    pub model: Option<&'a RawValue>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
pub struct Choice<'a> {
    pub index: Option<i64>,
    pub token_ids: Option<Vec<u32>>,
    pub output_ids: Option<Vec<u32>>,
    pub prompt_token_ids: Option<Vec<u32>>,
    pub finish_reason: Option<String>,
    logprobs: Option<WireLogprobs>,
    message: Option<WireMessage>,
    #[serde(borrow)]
    pub delta: Option<Delta<'a>>,
    pub text: Option<String>,
    /// vLLM's matched stop string (or stop token id).
    #[serde(borrow)]
    pub stop_reason: Leaf<'a>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
struct WireMessage {
    content: Option<String>,
}

/// A streamed choice's delta.
#[derive(Debug, Deserialize, Default)]
#[serde(default)]
pub struct Delta<'a> {
    pub content: Option<String>,
    /// vLLM's newer name for the reasoning text.
    #[serde(borrow)]
    pub reasoning: Leaf<'a>,
    /// vLLM's older name for the reasoning text.
    #[serde(borrow)]
    pub reasoning_content: Leaf<'a>,
    #[serde(borrow)]
    pub tool_calls: List<Obj<ToolCallDelta<'a>>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
pub struct ToolCallDelta<'a> {
    #[serde(borrow)]
    pub index: Leaf<'a>,
    #[serde(borrow)]
    pub id: Leaf<'a>,
    #[serde(borrow)]
    pub function: Obj<FunctionDelta<'a>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
pub struct FunctionDelta<'a> {
    #[serde(borrow)]
    pub name: Leaf<'a>,
    #[serde(borrow)]
    pub arguments: Leaf<'a>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(default)]
struct WireLogprobs {
    /// Chat: one entry per generated token; only each entry's `logprob` is kept.
    content: Option<LogprobList>,
    /// Completions: one value (or null) per generated token.
    token_logprobs: Option<LogprobList>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct WireTokenLogprob {
    logprob: Option<f64>,
}

/// A list of logprobs read straight into `f32`s (NaN where the engine sent
/// null): either chat entries (`{"logprob": x, "token": …, "top_logprobs": …}`,
/// everything but `logprob` skipped unread) or bare numbers. No intermediate
/// list of entries: the logprobs are most of a 26 KB answer's bytes.
#[derive(Debug, Default)]
struct LogprobList(Vec<f32>);

impl<'de> Deserialize<'de> for LogprobList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = LogprobList;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of logprobs (numbers, nulls or {\"logprob\": …} objects)")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<LogprobList, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(e) = seq.next_element::<LogprobEntry>()? {
                    out.push(e.0.map(|x| x as f32).unwrap_or(f32::NAN));
                }
                Ok(LogprobList(out))
            }
        }
        d.deserialize_seq(Entries)
    }
}

/// One list entry: a number, null, or a chat `{"logprob": …}` object.
struct LogprobEntry(Option<f64>);

impl<'de> Deserialize<'de> for LogprobEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entry;
        impl<'de> serde::de::Visitor<'de> for Entry {
            type Value = LogprobEntry;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a logprob: a number, null or {\"logprob\": …}")
            }
            fn visit_f64<E>(self, x: f64) -> Result<LogprobEntry, E> {
                Ok(LogprobEntry(Some(x)))
            }
            fn visit_i64<E>(self, x: i64) -> Result<LogprobEntry, E> {
                Ok(LogprobEntry(Some(x as f64)))
            }
            fn visit_u64<E>(self, x: u64) -> Result<LogprobEntry, E> {
                Ok(LogprobEntry(Some(x as f64)))
            }
            fn visit_unit<E>(self) -> Result<LogprobEntry, E> {
                Ok(LogprobEntry(None))
            }
            fn visit_none<E>(self) -> Result<LogprobEntry, E> {
                Ok(LogprobEntry(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<LogprobEntry, A::Error> {
                let t = WireTokenLogprob::deserialize(
                    serde::de::value::MapAccessDeserializer::new(map),
                )?;
                Ok(LogprobEntry(t.logprob))
            }
        }
        d.deserialize_any(Entry)
    }
}

impl WireLogprobs {
    fn into_values(self) -> Option<Vec<f32>> {
        self.content.or(self.token_logprobs).map(|l| l.0)
    }

    fn values(&self) -> Option<&[f32]> {
        self.content
            .as_ref()
            .or(self.token_logprobs.as_ref())
            .map(|l| &l.0[..])
    }
}

/// The chunk of one engine SSE event: `None` for `[DONE]` and for an event
/// without data, an error for data that is not a chunk.
pub fn read_event(ev: &Event) -> Result<Option<Chunk<'_>>, String> {
    if ev.is_done() || ev.data.trim_ascii().is_empty() {
        return Ok(None);
    }
    from_json(&ev.data).map(Some)
}

/// JSON from bytes: one UTF-8 check over the whole text, then a parse that
/// trusts it (serde_json's slice reader validates every string it meets, one
/// call each: a fifth of a streamed chunk's parse).
pub(crate) fn from_json<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
    serde_json::from_str(text).map_err(|e| e.to_string())
}

/// Parses a whole (non-streamed) answer.
pub fn parse_answer(body: &[u8]) -> Result<Capture, String> {
    let a: Chunk =
        from_json(body).map_err(|e| format!("engine answer is not the expected JSON: {e}"))?;
    let choices = a
        .choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = c.logprobs.and_then(WireLogprobs::into_values);
            let text = c.message.and_then(|m| m.content).or(c.text);
            ChoiceCapture {
                index: c.index.unwrap_or(i as i64),
                prompt_ids: c.prompt_token_ids,
                completion_ids: c.token_ids.or(c.output_ids),
                logprobs,
                finish_reason: c.finish_reason,
                text,
            }
        })
        .collect();
    Ok(Capture {
        id: a.id,
        prompt_ids: a.prompt_token_ids,
        choices,
        usage: a.usage,
    })
}

/// Accumulates a streamed answer chunk by chunk.
#[derive(Debug, Default)]
pub struct StreamCapture {
    id: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    choices: BTreeMap<i64, ChoiceCapture>,
    usage: Option<serde_json::Value>,
    /// Chunks that did not parse (kept so the call is flagged, never silently wrong).
    pub bad_chunks: usize,
    /// An `error` object the engine sent inside the stream.
    pub engine_error: Option<serde_json::Value>,
}

impl StreamCapture {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the data of one SSE event (not `[DONE]`); data that is not a
    /// chunk is counted in `bad_chunks`.
    pub fn feed(&mut self, data: &[u8]) {
        if data.trim_ascii().is_empty() {
            return;
        }
        match from_json(data) {
            Ok(chunk) => self.add(&chunk),
            Err(_) => self.bad_chunks += 1,
        }
    }

    /// Adds one chunk read by [`read_event`] (which the translator reads too).
    pub fn add(&mut self, chunk: &Chunk<'_>) {
        if let Some(err) = &chunk.error {
            self.engine_error = Some(err.clone());
            return;
        }
        if self.id.is_none() {
            self.id.clone_from(&chunk.id);
        }
        if let Some(p) = &chunk.prompt_token_ids {
            self.prompt_ids.get_or_insert_with(Vec::new).extend(p);
        }
        if chunk.usage.is_some() {
            self.usage.clone_from(&chunk.usage);
        }
        for (i, c) in chunk.choices.iter().enumerate() {
            let idx = c.index.unwrap_or(i as i64);
            let slot = self.choices.entry(idx).or_insert_with(|| ChoiceCapture {
                index: idx,
                ..Default::default()
            });
            if let Some(p) = &c.prompt_token_ids {
                slot.prompt_ids.get_or_insert_with(Vec::new).extend(p);
            }
            if let Some(ids) = c.token_ids.as_ref().or(c.output_ids.as_ref()) {
                slot.completion_ids.get_or_insert_with(Vec::new).extend(ids);
            }
            if let Some(lp) = c.logprobs.as_ref().and_then(WireLogprobs::values) {
                slot.logprobs.get_or_insert_with(Vec::new).extend(lp);
            }
            if c.finish_reason.is_some() {
                slot.finish_reason.clone_from(&c.finish_reason);
            }
            let piece = c.delta.as_ref().and_then(|d| d.content.as_ref());
            if let Some(t) = piece.or(c.text.as_ref()) {
                slot.text.get_or_insert_with(String::new).push_str(t);
            }
        }
    }

    /// Every choice seen has a finish_reason (and at least one was seen).
    pub fn all_finished(&self) -> bool {
        !self.choices.is_empty() && self.choices.values().all(|c| c.finish_reason.is_some())
    }

    pub fn finish(self) -> Capture {
        Capture {
            id: self.id,
            prompt_ids: self.prompt_ids,
            choices: self.choices.into_values().collect(),
            usage: self.usage,
        }
    }
}

/// Consistency flags for a capture: what is missing or contradicts itself.
/// `no_ids`: engine sent no completion ids (text only); `no_prompt_ids`;
/// `no_logprobs`; `logprobs_count_mismatch`: logprob count != id count;
/// `ids_usage_mismatch`: total completion ids != `usage.completion_tokens`;
/// `prompt_usage_mismatch`: prompt ids != `usage.prompt_tokens` (single prompt only).
pub fn check(kind: Kind, cap: &Capture, want_ids: bool) -> Vec<Vec<String>> {
    let mut per_choice: Vec<Vec<String>> = Vec::with_capacity(cap.choices.len());
    let mut total_ids: u64 = 0;
    let mut all_have_ids = true;
    for c in &cap.choices {
        let mut f = Vec::new();
        match &c.completion_ids {
            None => {
                all_have_ids = false;
                if want_ids {
                    f.push("no_ids".to_string());
                }
            }
            Some(ids) => {
                total_ids += ids.len() as u64;
                match &c.logprobs {
                    None => {
                        if want_ids {
                            f.push("no_logprobs".to_string())
                        }
                    }
                    Some(lp) if lp.len() != ids.len() => {
                        f.push("logprobs_count_mismatch".to_string())
                    }
                    Some(_) => {}
                }
            }
        }
        let prompt = match kind {
            Kind::Chat => cap.prompt_ids.as_ref(),
            Kind::Completion => c.prompt_ids.as_ref(),
        };
        if prompt.is_none() && want_ids {
            f.push("no_prompt_ids".to_string());
        }
        per_choice.push(f);
    }
    if let Some(usage) = &cap.usage {
        if all_have_ids && !cap.choices.is_empty() {
            if let Some(ct) = usage.get("completion_tokens").and_then(|x| x.as_u64()) {
                if ct != total_ids {
                    per_choice
                        .iter_mut()
                        .for_each(|f| f.push("ids_usage_mismatch".to_string()));
                }
            }
        }
        let single_prompt = match kind {
            Kind::Chat => cap.prompt_ids.as_ref(),
            Kind::Completion => {
                let first = cap.choices.first().and_then(|c| c.prompt_ids.as_ref());
                let same = cap.choices.iter().all(|c| c.prompt_ids.as_ref() == first);
                if same {
                    first
                } else {
                    None
                }
            }
        };
        if let (Some(p), Some(pt)) = (
            single_prompt,
            usage.get("prompt_tokens").and_then(|x| x.as_u64()),
        ) {
            if p.len() as u64 != pt {
                per_choice
                    .iter_mut()
                    .for_each(|f| f.push("prompt_usage_mismatch".to_string()));
            }
        }
    }
    per_choice
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_answer() {
        let body = br#"{"id":"x","object":"chat.completion","prompt_token_ids":[1,2,3],
            "choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"token_ids":[7,8],
            "logprobs":{"content":[{"token":"h","logprob":-0.5,"bytes":[104],"top_logprobs":[]},
            {"token":"i","logprob":-1.25,"bytes":[105],"top_logprobs":[]}]},"finish_reason":"stop"}],
            "usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;
        let cap = parse_answer(body).unwrap_or_default();
        assert_eq!(cap.prompt_ids, Some(vec![1, 2, 3]));
        assert_eq!(cap.choices[0].completion_ids, Some(vec![7, 8]));
        assert_eq!(cap.choices[0].logprobs, Some(vec![-0.5, -1.25]));
        assert_eq!(cap.choices[0].text.as_deref(), Some("hi"));
        assert_eq!(check(Kind::Chat, &cap, true), vec![Vec::<String>::new()]);
    }

    #[test]
    fn stream_accumulates_and_flags_mismatch() {
        let mut s = StreamCapture::new();
        s.feed(br#"{"prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"token_ids":[]}]}"#);
        s.feed(br#"{"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5],"logprobs":{"content":[{"token":"a","logprob":-0.1}]}}]}"#);
        s.feed(br#"{"choices":[{"index":0,"delta":{"content":"b"},"token_ids":[6],"logprobs":{"content":[{"token":"b","logprob":-0.2}]},"finish_reason":"stop"}],"usage":{"prompt_tokens":2,"completion_tokens":3}}"#);
        let cap = s.finish();
        assert_eq!(cap.choices[0].completion_ids, Some(vec![5, 6]));
        assert_eq!(cap.choices[0].text.as_deref(), Some("ab"));
        let flags = check(Kind::Chat, &cap, true);
        assert_eq!(flags[0], vec!["ids_usage_mismatch".to_string()]);
    }

    #[test]
    fn escaped_strings_read_whole() {
        // JSON escapes in a chunk's id, text piece and finish reason, streamed
        // and whole, read as the text they stand for.
        let mut s = StreamCapture::new();
        s.feed(br#"{"id":"chat\u0041","choices":[{"index":0,"delta":{"content":"a\n\"b\""},"token_ids":[5]}]}"#);
        s.feed(br#"{"id":"other","choices":[{"index":0,"delta":{"content":" c\u00e9"},"token_ids":[6],"finish_reason":"st\u006fp"}]}"#);
        let cap = s.finish();
        assert_eq!(cap.id.as_deref(), Some("chatA"));
        assert_eq!(cap.choices[0].text.as_deref(), Some("a\n\"b\" c\u{e9}"));
        assert_eq!(cap.choices[0].finish_reason.as_deref(), Some("stop"));
        let whole = parse_answer(
            br#"{"id":"x\ty","choices":[{"message":{"content":"plain"},"finish_reason":"length"},{"text":"t\u00e9"}]}"#,
        )
        .unwrap_or_default();
        assert_eq!(whole.id.as_deref(), Some("x\ty"));
        assert_eq!(whole.choices[0].text.as_deref(), Some("plain"));
        assert_eq!(whole.choices[0].finish_reason.as_deref(), Some("length"));
        assert_eq!(whole.choices[1].text.as_deref(), Some("t\u{e9}"));
    }

    #[test]
    fn logprobs_read_as_f32_with_nan_for_null() {
        // Completions: bare numbers and nulls; chat: objects whose other
        // fields (escaped tokens, nested top_logprobs) are skipped unread.
        let body = br#"{"choices":[{"index":0,"text":"ab","token_ids":[1,2,3],
            "logprobs":{"token_logprobs":[-0.5,null,-2],"tokens":["a","b","c"]}}]}"#;
        let cap = parse_answer(body).unwrap_or_default();
        let lp = cap.choices[0].logprobs.clone().unwrap_or_default();
        assert_eq!(lp.len(), 3);
        assert_eq!((lp[0], lp[2]), (-0.5, -2.0));
        assert!(lp[1].is_nan());
        let body = br#"{"choices":[{"index":0,"message":{"content":"x"},"token_ids":[4,5],
            "logprobs":{"content":[{"token":"\"q\"","top_logprobs":[{"token":"z","logprob":-9}],"logprob":-0.25},
            {"token":"y","logprob":null}]}}]}"#;
        let cap = parse_answer(body).unwrap_or_default();
        let lp = cap.choices[0].logprobs.clone().unwrap_or_default();
        assert_eq!(lp.len(), 2);
        assert_eq!(lp[0], -0.25);
        assert!(lp[1].is_nan());
        // A logprob that is neither number, null nor object fails the parse.
        assert!(parse_answer(br#"{"choices":[{"logprobs":{"token_logprobs":["x"]}}]}"#).is_err());
    }

    /// Every one of `bodies`, as an event's data, is refused by `read_event`.
    fn assert_unreadable(bodies: &[&[u8]]) {
        for &body in bodies {
            assert!(
                read_event(&event(body)).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    fn event(data: &[u8]) -> Event {
        Event {
            raw: [b"data: ", data, b"\n\n"].concat(),
            data: data.to_vec(),
        }
    }

    #[test]
    fn one_read_serves_the_capture_and_the_translators() {
        // The translators' fields read whatever they hold: the capture still
        // takes the chunk, and each field reads as `Value::as_str` would.
        let data = br#"{"model":{"a":1},"choices":[{"index":0,"delta":{"content":"a","reasoning":5,
            "tool_calls":"x"},"stop_reason":[1],"token_ids":[7]}]}"#;
        let ev = event(data);
        let chunk = read_event(&ev).unwrap_or_default().unwrap_or_default();
        assert_eq!(chunk.model.map(RawValue::get), Some(r#"{"a":1}"#));
        let choice = &chunk.choices[0];
        assert_eq!(choice.stop_reason, Leaf::Other);
        let delta = choice
            .delta
            .as_ref()
            .map(|d| (d.reasoning.as_str(), d.tool_calls.0.len()));
        assert_eq!(delta, Some((None, 0)));
        let mut s = StreamCapture::new();
        s.add(&chunk);
        let cap = s.finish();
        assert_eq!(cap.choices[0].text.as_deref(), Some("a"));
        assert_eq!(cap.choices[0].completion_ids, Some(vec![7]));
        // `[DONE]` and an event without data carry no chunk.
        assert!(matches!(read_event(&event(b" [DONE]")), Ok(None)));
        assert!(matches!(read_event(&event(b"")), Ok(None)));
        // A field the capture records of another type refuses the chunk (the
        // translators read it leniently once, and no longer see it).
        assert_unreadable(&[
            br#"{"choices":[{"delta":5}]}"#,
            br#"{"choices":[{"delta":{"content":1}}]}"#,
            b"5",
        ]);
    }

    #[test]
    fn null_error_and_repeated_keys_read_one_way() {
        // `"error": null` is no error, for the capture and so for the translators
        // (which once read any `error` key, even null, as the engine failing).
        let ev = event(br#"{"error":null,"choices":[{"index":0,"delta":{"content":"a"}}]}"#);
        let chunk = read_event(&ev).unwrap_or_default().unwrap_or_default();
        assert!(chunk.error.is_none());
        let mut s = StreamCapture::new();
        s.add(&chunk);
        assert!(s.engine_error.is_none());
        // A key given twice refuses the chunk, in a field the capture records
        // and in one only the translators read (which once took the last).
        assert_unreadable(&[
            br#"{"choices":[{"delta":{"content":"a","content":"b"}}]}"#,
            br#"{"choices":[{"delta":{"reasoning":"a","reasoning":"b"}}]}"#,
            br#"{"model":"a","model":"b"}"#,
        ]);
    }

    #[test]
    fn garbage_never_panics() {
        for body in [
            &b""[..],
            b"{",
            b"[]",
            b"{\"choices\":5}",
            b"{\"choices\":[{\"token_ids\":[-1]}]}",
        ] {
            let _ = parse_answer(body);
            let mut s = StreamCapture::new();
            s.feed(body);
            let _ = s.finish();
        }
    }
}
