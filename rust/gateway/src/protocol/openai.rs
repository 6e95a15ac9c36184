//! OpenAI chat completions (`POST /v1/chat/completions`) and completions
//! (`POST /v1/completions`): the engine's own dialects, so one adapter serves
//! both. It only switches ids and logprobs on (`logprobs` as chat's boolean or
//! completions' count) and passes the engine's answer through unchanged (extra
//! fields such as `token_ids` are harmless to OpenAI clients; docs/design.md#wire-format).

use bytes::Bytes;
use hyper::StatusCode;
use serde_json::{Map, Value};

use super::{object, Answer, Ctx, EngineRequest, Kept, Protocol, StreamTranslator};
use crate::error::ApiError;
use crate::wire::engine::{Chunk, Kind};
use crate::wire::sse::Event;

/// The OpenAI dialect of one engine route: chat completions or completions.
#[derive(Debug, Clone, Copy)]
pub struct OpenAi(pub Kind);

/// Sets what every engine request needs: ids and logprobs when captured
/// (`logprobs` as chat's boolean or completions' count), the mode's temperature.
pub(crate) fn capture_fields(req: &mut Map<String, Value>, kind: Kind, ctx: &Ctx) {
    if ctx.want_ids {
        req.insert("return_token_ids".into(), Value::Bool(true));
        match kind {
            Kind::Chat => {
                req.insert("logprobs".into(), Value::Bool(true));
            }
            Kind::Completion => {
                if req.get("logprobs").is_none_or(|x| x.as_u64().is_none()) {
                    req.insert("logprobs".into(), Value::from(0));
                }
            }
        }
    }
    if let Some(t) = ctx.temperature {
        req.insert("temperature".into(), Value::from(t));
    }
}

/// Ids and logprobs on, the mode's temperature; the rest passes through untouched.
pub(crate) fn passthrough_request(
    body: Value,
    kind: Kind,
    ctx: &mut Ctx,
) -> Result<EngineRequest, ApiError> {
    let mut req = object(body)?;
    if ctx.client_fields_only {
        // What the client itself asked for, before the capture adds its own.
        let logprobs = match kind {
            Kind::Chat => req.get("logprobs").and_then(Value::as_bool) == Some(true),
            Kind::Completion => req.get("logprobs").is_some_and(Value::is_u64),
        };
        let ids = req.get("return_token_ids").and_then(Value::as_bool) == Some(true);
        ctx.state = serde_json::json!({"logprobs": logprobs, "ids": ids});
    }
    capture_fields(&mut req, kind, ctx);
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    Ok(EngineRequest {
        kind,
        body: req,
        stream,
    })
}

/// `{"error": {"message", "type", "code"}}`, OpenAI's error shape.
pub(crate) fn openai_error(e: &ApiError) -> Bytes {
    Bytes::from(e.body())
}

impl Protocol for OpenAi {
    fn name(&self) -> &'static str {
        match self.0 {
            Kind::Chat => "openai_chat",
            Kind::Completion => "openai_completions",
        }
    }

    fn check(
        &self,
        req: &Map<String, Value>,
        caps: &super::validate::Caps,
    ) -> Result<(), ApiError> {
        match self.0 {
            Kind::Chat => super::validate::chat(req, caps),
            Kind::Completion => super::validate::completions(req, caps),
        }
    }

    fn engine_request(&self, body: Value, ctx: &mut Ctx) -> Result<EngineRequest, ApiError> {
        passthrough_request(body, self.0, ctx)
    }

    fn answer(&self, status: StatusCode, engine: &Bytes, ctx: &Ctx) -> (Answer, Option<Kept>) {
        let Some(keep) = Unasked::of(ctx) else {
            return (Answer::Passthrough, None);
        };
        match serde_json::from_slice::<Value>(engine) {
            Ok(mut v) if status.is_success() => {
                keep.strip(&mut v);
                let body = Bytes::from(v.to_string());
                (Answer::Json { status, body }, None)
            }
            _ => (Answer::Passthrough, None),
        }
    }

    fn translator(&self, ctx: &Ctx) -> Box<dyn StreamTranslator> {
        Box::new(Passthrough {
            done: None,
            strip: Unasked::of(ctx),
        })
    }

    fn error_body(&self, e: &ApiError) -> Bytes {
        openai_error(e)
    }
}

/// The capture fields a client did not ask for, to take out of its answer
/// (`None`: the client gets the engine's answer unchanged).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unasked {
    logprobs: bool,
    ids: bool,
}

impl Unasked {
    fn of(ctx: &Ctx) -> Option<Unasked> {
        if !ctx.client_fields_only {
            return None;
        }
        let asked = |k: &str| ctx.state.get(k).and_then(Value::as_bool) == Some(true);
        Some(Unasked {
            logprobs: !asked("logprobs"),
            ids: !asked("ids"),
        })
    }

    /// Removes them from an answer or a stream chunk (vLLM's field names, docs/design.md#wire-format).
    fn strip(self, v: &mut Value) {
        let Some(top) = v.as_object_mut() else { return };
        top.remove("kv_transfer_params");
        if self.ids {
            top.remove("prompt_token_ids");
        }
        let choices = top.get_mut("choices").and_then(Value::as_array_mut);
        for c in choices.into_iter().flatten() {
            let Some(c) = c.as_object_mut() else { continue };
            if self.ids {
                c.remove("token_ids");
                c.remove("prompt_token_ids");
            }
            if self.logprobs {
                c.remove("logprobs");
            }
        }
    }
}

/// Forwards every engine event unchanged (or without the fields the client
/// did not ask for), holding back only `[DONE]` (chat completions and
/// completions share it).
#[derive(Debug, Default)]
pub(crate) struct Passthrough {
    done: Option<Vec<u8>>,
    strip: Option<Unasked>,
}

impl StreamTranslator for Passthrough {
    fn on_event(&mut self, ev: &Event, _: Option<&Chunk<'_>>, out: &mut Vec<u8>) {
        if ev.is_done() {
            self.done = Some(ev.raw.clone());
            return;
        }
        let stripped = self.strip.and_then(|keep| {
            let mut v = serde_json::from_slice::<Value>(&ev.data).ok()?;
            keep.strip(&mut v);
            Some(v)
        });
        match stripped {
            Some(v) => super::sse_frame(out, None, v.to_string().as_bytes()),
            None => out.extend_from_slice(&ev.raw),
        }
    }

    fn finish(&mut self) -> (Vec<u8>, Option<Kept>) {
        (self.done.take().unwrap_or_default(), None)
    }

    fn fail(&mut self, e: &ApiError) -> Vec<u8> {
        let mut out = Vec::new();
        super::sse_frame(&mut out, None, &e.body());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::sse::Parser;
    use serde_json::json;

    fn ctx(want_ids: bool, temperature: Option<f64>) -> Ctx {
        Ctx {
            want_ids,
            temperature,
            ..Default::default()
        }
    }

    #[test]
    fn switches_ids_on_and_keeps_the_rest() {
        let body = json!({"model": "m", "messages": [], "stream": true, "top_p": 0.5});
        let r = OpenAi(Kind::Chat)
            .engine_request(body, &mut ctx(true, Some(0.7)))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(r.stream);
        assert_eq!(r.kind, Kind::Chat);
        assert_eq!(r.body["return_token_ids"], json!(true));
        assert_eq!(r.body["logprobs"], json!(true));
        assert_eq!(r.body["temperature"], json!(0.7));
        assert_eq!(r.body["top_p"], json!(0.5));
        let r = OpenAi(Kind::Chat)
            .engine_request(json!({"messages": []}), &mut ctx(false, None))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!r.body.contains_key("return_token_ids"));
        assert!(OpenAi(Kind::Chat)
            .engine_request(json!([1]), &mut ctx(true, None))
            .is_err());
    }

    #[test]
    fn completions_logprobs_become_a_count_unless_given() {
        let r = OpenAi(Kind::Completion)
            .engine_request(json!({"prompt": "x"}), &mut ctx(true, None))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.kind, Kind::Completion);
        assert_eq!(r.body["logprobs"], json!(0));
        let r = OpenAi(Kind::Completion)
            .engine_request(json!({"prompt": "x", "logprobs": 3}), &mut ctx(true, None))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.body["logprobs"], json!(3));
        assert_eq!(OpenAi(Kind::Completion).name(), "openai_completions");
    }

    #[test]
    fn application_keys_get_only_what_they_asked_for() {
        let engine = json!({"id": "c", "prompt_token_ids": [1], "kv_transfer_params": null,
            "choices": [{"index": 0, "message": {"content": "hi"}, "token_ids": [2],
                         "logprobs": {"content": []}}]});
        let answer = |body: Value, online: bool| {
            let mut c = ctx(true, None);
            c.client_fields_only = online;
            let _ = OpenAi(Kind::Chat).engine_request(body, &mut c);
            match OpenAi(Kind::Chat).answer(StatusCode::OK, &Bytes::from(engine.to_string()), &c) {
                (Answer::Json { body, .. }, _) => serde_json::from_slice(&body).unwrap_or_default(),
                (Answer::Passthrough, _) => engine.clone(),
            }
        };
        assert_eq!(answer(json!({"messages": []}), false), engine);
        let plain: Value = answer(json!({"messages": []}), true);
        assert_eq!(
            plain,
            json!({"id": "c", "choices": [{"index": 0, "message": {"content": "hi"}}]})
        );
        let asked: Value = answer(json!({"messages": [], "logprobs": true}), true);
        assert_eq!(asked["choices"][0]["logprobs"], json!({"content": []}));
        assert!(asked.get("prompt_token_ids").is_none());
        // Streamed: each chunk loses the same fields.
        let mut c = ctx(true, None);
        c.client_fields_only = true;
        let _ = OpenAi(Kind::Chat).engine_request(json!({"messages": []}), &mut c);
        let mut t = OpenAi(Kind::Chat).translator(&c);
        let mut p = Parser::new();
        let sse = format!("data: {engine}\n\n");
        let events = p.feed(sse.as_bytes()).unwrap_or_default();
        let mut out = Vec::new();
        for ev in &events {
            crate::protocol::translate_event(t.as_mut(), ev, &mut out);
        }
        let text = String::from_utf8(out).unwrap_or_default();
        assert!(
            !text.contains("token_ids") && !text.contains("logprobs"),
            "{text}"
        );
    }

    #[test]
    fn passthrough_holds_back_only_done() {
        let mut p = Parser::new();
        let events = p
            .feed(b"data: {\"a\":1}\n\ndata: [DONE]\n\n")
            .unwrap_or_default();
        let mut t = OpenAi(Kind::Chat).translator(&Ctx::default());
        let mut out = Vec::new();
        for ev in &events {
            crate::protocol::translate_event(t.as_mut(), ev, &mut out);
        }
        assert_eq!(out, b"data: {\"a\":1}\n\n");
        assert_eq!(t.finish().0, b"data: [DONE]\n\n");
    }
}
