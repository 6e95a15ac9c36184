//! The door: each protocol's request shape, checked before anything reaches
//! the engine or the store (issue 26).
//!
//! A request the engine would refuse (a string where a list belongs, `stream:
//! "yes"`, `max_tokens: "ten"`) is the client's error: it gets a 400 in its
//! protocol's shape at once, never a retried 502, and nothing is recorded.
//! Sizes a client may ask the engine for (`n`, the output token budget, the
//! number of top logprobs) are capped by the gateway config ([`Caps`]), so one
//! request cannot make the engine generate a million answers.
//!
//! Only the fields the gateway or the engine reads are checked, and only their
//! JSON type and range; what the adapters translate (message roles, content
//! blocks, tools) they check themselves. Unknown fields pass through.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// The sizes a client may ask for (config: `max_n`, `max_output_tokens`,
/// `max_top_logprobs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Answers per request (`n`, completions' `best_of`).
    pub n: u64,
    /// Tokens one answer may generate (`max_tokens`, `max_completion_tokens`,
    /// Responses' `max_output_tokens`, Messages' `max_tokens`).
    pub output_tokens: u64,
    /// Alternatives per token (`top_logprobs`, completions' `logprobs`).
    pub top_logprobs: u64,
}

impl Default for Caps {
    fn default() -> Self {
        Caps {
            n: 16,
            output_tokens: 262_144,
            top_logprobs: 20,
        }
    }
}

fn invalid(message: String) -> ApiError {
    ApiError::bad_request("invalid_request", message)
}

/// A short rendering of a bad value for a message (a huge string is cut).
fn shown(v: &Value) -> String {
    let s = v.to_string();
    if s.len() <= 80 {
        return s;
    }
    let mut end = 77;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Field checks on one request object; absent and `null` fields pass unless required.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn present(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn bool(&self, key: &str) -> Result<(), ApiError> {
        match self.present(key) {
            None | Some(Value::Bool(_)) => Ok(()),
            Some(v) => Err(invalid(format!(
                "`{key}` must be true or false, got {}",
                shown(v)
            ))),
        }
    }

    fn number(&self, key: &str) -> Result<(), ApiError> {
        match self.present(key) {
            None => Ok(()),
            Some(Value::Number(_)) => Ok(()),
            Some(v) => Err(invalid(format!(
                "`{key}` must be a number, got {}",
                shown(v)
            ))),
        }
    }

    fn string(&self, key: &str) -> Result<(), ApiError> {
        match self.present(key) {
            None | Some(Value::String(_)) => Ok(()),
            Some(v) => Err(invalid(format!(
                "`{key}` must be a string, got {}",
                shown(v)
            ))),
        }
    }

    fn object(&self, key: &str) -> Result<(), ApiError> {
        match self.present(key) {
            None | Some(Value::Object(_)) => Ok(()),
            Some(v) => Err(invalid(format!(
                "`{key}` must be an object, got {}",
                shown(v)
            ))),
        }
    }

    fn list(&self, key: &str) -> Result<(), ApiError> {
        match self.present(key) {
            None | Some(Value::Array(_)) => Ok(()),
            Some(v) => Err(invalid(format!("`{key}` must be a list, got {}", shown(v)))),
        }
    }

    /// An integer in `min..=cap`; `cap` names the config field that sets it.
    fn int(&self, key: &str, min: u64, cap: Option<(u64, &str)>) -> Result<(), ApiError> {
        let Some(v) = self.present(key) else {
            return Ok(());
        };
        let n = match v.as_u64() {
            Some(n) if n >= min => n,
            _ => {
                return Err(invalid(format!(
                    "`{key}` must be an integer >= {min}, got {}",
                    shown(v)
                )))
            }
        };
        match cap {
            Some((max, field)) if n > max => Err(ApiError::bad_request(
                "limit_exceeded",
                format!(
                    "`{key}` = {n} is above this gateway's limit of {max}; ask for at most {max} (the operator sets {field} in the gateway config)"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// `stop`: a string or a list of strings.
    fn stop(&self, key: &str) -> Result<(), ApiError> {
        match self.present(key) {
            None | Some(Value::String(_)) => Ok(()),
            Some(Value::Array(a)) if a.iter().all(Value::is_string) => Ok(()),
            Some(v) => Err(invalid(format!(
                "`{key}` must be a string or a list of strings, got {}",
                shown(v)
            ))),
        }
    }
}

/// Sampling fields chat and completions share.
fn sampling(f: &Fields<'_>, caps: &Caps) -> Result<(), ApiError> {
    f.string("model")?;
    f.bool("stream")?;
    f.object("stream_options")?;
    for k in [
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
    ] {
        f.number(k)?;
    }
    f.int("n", 1, Some((caps.n, "max_n")))?;
    f.int("best_of", 1, Some((caps.n, "max_n")))?;
    f.int(
        "max_tokens",
        1,
        Some((caps.output_tokens, "max_output_tokens")),
    )?;
    f.int(
        "max_completion_tokens",
        1,
        Some((caps.output_tokens, "max_output_tokens")),
    )?;
    f.int(
        "min_tokens",
        0,
        Some((caps.output_tokens, "max_output_tokens")),
    )?;
    f.stop("stop")?;
    f.object("logit_bias")?;
    match f.present("seed") {
        None => Ok(()),
        Some(v) if v.is_i64() || v.is_u64() => Ok(()),
        Some(v) => Err(invalid(format!(
            "`seed` must be an integer, got {}",
            shown(v)
        ))),
    }
}

/// OpenAI chat completions: `messages` is a list of `{role, ...}` objects.
pub fn chat(req: &Map<String, Value>, caps: &Caps) -> Result<(), ApiError> {
    let f = Fields(req);
    match req.get("messages") {
        Some(Value::Array(list)) => {
            for (i, m) in list.iter().enumerate() {
                if !m.get("role").is_some_and(Value::is_string) {
                    return Err(invalid(format!(
                        "`messages[{i}]` must be an object with a string `role`, got {}",
                        shown(m)
                    )));
                }
            }
        }
        Some(v) => {
            return Err(invalid(format!(
                "`messages` must be a list of {{role, content}} objects, got {}",
                shown(v)
            )))
        }
        None => return Err(invalid("`messages` is required".into())),
    }
    sampling(&f, caps)?;
    f.bool("logprobs")?;
    f.int(
        "top_logprobs",
        0,
        Some((caps.top_logprobs, "max_top_logprobs")),
    )?;
    f.list("tools")?;
    Ok(())
}

/// OpenAI completions: `prompt` is text, a list of texts, token ids or lists of ids.
pub fn completions(req: &Map<String, Value>, caps: &Caps) -> Result<(), ApiError> {
    let f = Fields(req);
    let ids = |v: &Value| v.as_array().is_some_and(|a| a.iter().all(Value::is_u64));
    let ok = match req.get("prompt") {
        Some(Value::String(_)) => true,
        Some(p @ Value::Array(a)) => {
            !a.is_empty() && (a.iter().all(Value::is_string) || ids(p) || a.iter().all(ids))
        }
        Some(_) => false,
        None => return Err(invalid("`prompt` is required".into())),
    };
    if !ok {
        return Err(invalid(format!(
            "`prompt` must be a string, a list of strings or a list of token ids, got {}",
            shown(&req["prompt"])
        )));
    }
    sampling(&f, caps)?;
    f.int("logprobs", 0, Some((caps.top_logprobs, "max_top_logprobs")))?;
    f.bool("echo")?;
    f.string("suffix")?;
    Ok(())
}

/// The Responses API: `input` is a string or a list of items (`null` is not
/// an input: answering it would record a call with no conversation).
pub fn responses(req: &Map<String, Value>, caps: &Caps) -> Result<(), ApiError> {
    let f = Fields(req);
    match req.get("input") {
        Some(Value::String(_)) => {}
        Some(Value::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                if !it.is_object() {
                    return Err(invalid(format!(
                        "`input[{i}]` must be an item object, got {}",
                        shown(it)
                    )));
                }
            }
        }
        None | Some(Value::Null) => {
            return Err(invalid(
                "`input` is required: a string or a list of input items".into(),
            ))
        }
        Some(v) => {
            return Err(invalid(format!(
                "`input` must be a string or a list of input items, got {}",
                shown(v)
            )))
        }
    }
    match f.present("instructions") {
        None | Some(Value::String(_)) | Some(Value::Array(_)) => {}
        Some(v) => {
            return Err(invalid(format!(
                "`instructions` must be a string, got {}",
                shown(v)
            )))
        }
    }
    match f.present("conversation") {
        None | Some(Value::String(_)) => {}
        Some(Value::Object(o)) if o.get("id").is_some_and(Value::is_string) => {}
        Some(v) => {
            return Err(invalid(format!(
                "`conversation` must be a conversation id or {{\"id\": ...}}, got {}",
                shown(v)
            )))
        }
    }
    f.string("model")?;
    f.string("previous_response_id")?;
    for k in ["stream", "store", "background", "parallel_tool_calls"] {
        f.bool(k)?;
    }
    f.number("temperature")?;
    f.number("top_p")?;
    f.int(
        "max_output_tokens",
        1,
        Some((caps.output_tokens, "max_output_tokens")),
    )?;
    f.int(
        "top_logprobs",
        0,
        Some((caps.top_logprobs, "max_top_logprobs")),
    )?;
    f.list("tools")?;
    f.object("metadata")?;
    f.object("text")?;
    f.object("reasoning")?;
    Ok(())
}

/// Anthropic Messages: `messages` is a list, `max_tokens` a capped integer.
pub fn messages(req: &Map<String, Value>, caps: &Caps) -> Result<(), ApiError> {
    let f = Fields(req);
    match req.get("messages") {
        Some(Value::Array(list)) => {
            for (i, m) in list.iter().enumerate() {
                if !m.is_object() {
                    return Err(invalid(format!(
                        "`messages[{i}]` must be a {{role, content}} object, got {}",
                        shown(m)
                    )));
                }
            }
        }
        Some(v) => {
            return Err(invalid(format!(
                "`messages` must be a list of {{role, content}} objects, got {}",
                shown(v)
            )))
        }
        None => return Err(invalid("`messages` is required".into())),
    }
    f.string("model")?;
    f.bool("stream")?;
    f.int(
        "max_tokens",
        1,
        Some((caps.output_tokens, "max_output_tokens")),
    )?;
    f.int("top_k", 0, None)?;
    f.number("temperature")?;
    f.number("top_p")?;
    f.list("tools")?;
    f.object("metadata")?;
    match f.present("system") {
        None | Some(Value::String(_)) | Some(Value::Array(_)) => Ok(()),
        Some(v) => Err(invalid(format!(
            "`system` must be a string or a list of text blocks, got {}",
            shown(v)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    fn refused(
        check: fn(&Map<String, Value>, &Caps) -> Result<(), ApiError>,
        v: Value,
    ) -> ApiError {
        match check(&obj(v.clone()), &Caps::default()) {
            Err(e) => e,
            Ok(()) => panic!("{v} was accepted"),
        }
    }

    #[test]
    fn well_formed_requests_pass() {
        let caps = Caps::default();
        let ok = [
            (
                chat as fn(&_, &_) -> _,
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 5, "stream": false, "stop": ["x"], "temperature": null}),
            ),
            (
                completions,
                json!({"prompt": "hi", "logprobs": 3, "max_tokens": 8}),
            ),
            (completions, json!({"prompt": [[1, 2], [3]], "n": 16})),
            (
                responses,
                json!({"input": "hi", "max_output_tokens": 32, "conversation": {"id": "c"}}),
            ),
            (
                responses,
                json!({"input": [{"role": "user", "content": "hi"}], "instructions": "be brief"}),
            ),
            (
                messages,
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "system": "s"}),
            ),
        ];
        for (check, v) in ok {
            if let Err(e) = check(&obj(v.clone()), &caps) {
                panic!("{v} refused: {e}");
            }
        }
    }

    #[test]
    fn wrong_types_and_nulls_are_refused_naming_the_field() {
        let cases = [
            (
                chat as fn(&_, &_) -> _,
                json!({"messages": "hi"}),
                "`messages`",
            ),
            (
                chat,
                json!({"messages": [], "max_tokens": "ten"}),
                "`max_tokens`",
            ),
            (chat, json!({"messages": [], "stream": "yes"}), "`stream`"),
            (chat, json!({"messages": ["hi"]}), "`messages[0]`"),
            (chat, json!({}), "`messages` is required"),
            (completions, json!({"prompt": 5}), "`prompt`"),
            (completions, json!({"prompt": []}), "`prompt`"),
            (
                responses,
                json!({"instructions": "x", "input": null}),
                "`input` is required",
            ),
            (responses, json!({"input": 3}), "`input`"),
            (responses, json!({"input": [null]}), "`input[0]`"),
            (
                responses,
                json!({"input": "x", "conversation": 7}),
                "`conversation`",
            ),
            (
                messages,
                json!({"messages": null, "max_tokens": 1}),
                "`messages`",
            ),
            (
                messages,
                json!({"messages": [], "max_tokens": -1}),
                "`max_tokens`",
            ),
            (messages, json!({"messages": [], "system": 1}), "`system`"),
        ];
        for (check, v, named) in cases {
            let e = refused(check, v.clone());
            assert_eq!(e.status, 400, "{v}");
            assert!(e.message.contains(named), "{v}: {}", e.message);
        }
    }

    #[test]
    fn caps_refuse_huge_values_and_name_the_config_field() {
        let cases = [
            (
                chat as fn(&_, &_) -> _,
                json!({"messages": [], "n": 1_000_000}),
                "max_n",
            ),
            (
                chat,
                json!({"messages": [], "max_completion_tokens": 10_000_000}),
                "max_output_tokens",
            ),
            (
                chat,
                json!({"messages": [], "top_logprobs": 21}),
                "max_top_logprobs",
            ),
            (completions, json!({"prompt": "x", "best_of": 17}), "max_n"),
            (
                completions,
                json!({"prompt": "x", "logprobs": 100}),
                "max_top_logprobs",
            ),
            (
                responses,
                json!({"input": "x", "max_output_tokens": 1u64 << 40}),
                "max_output_tokens",
            ),
            (
                messages,
                json!({"messages": [], "max_tokens": 1u64 << 40}),
                "max_output_tokens",
            ),
        ];
        for (check, v, field) in cases {
            let e = refused(check, v.clone());
            assert_eq!((e.status, e.code), (400, "limit_exceeded"), "{v}");
            assert!(e.message.contains(field), "{v}: {}", e.message);
        }
        let small = Caps {
            n: 2,
            ..Caps::default()
        };
        assert!(chat(&obj(json!({"messages": [], "n": 3})), &small).is_err());
        assert!(chat(&obj(json!({"messages": [], "n": 2})), &small).is_ok());
    }

    #[test]
    fn a_huge_bad_value_is_shown_cut() {
        let e = refused(chat, json!({"messages": "é".repeat(1000)}));
        assert!(e.message.len() < 200, "{}", e.message);
    }
}
