//! OpenAI chat completions (`POST /v1/chat/completions`) and completions
//! (`POST /v1/completions`): the engine's own dialects, so one adapter serves
//! both. It only switches ids and logprobs on (`logprobs` as chat's boolean or
//! completions' count) and passes the engine's answer through unchanged (extra
//! fields such as `token_ids` are harmless to OpenAI clients; DESIGN.md §3).

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
    ctx: &Ctx,
) -> Result<EngineRequest, ApiError> {
    let mut req = object(body)?;
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

    fn answer(&self, _: StatusCode, _: &Bytes, _: &Ctx) -> (Answer, Option<Kept>) {
        (Answer::Passthrough, None)
    }

    fn translator(&self, _: &Ctx) -> Box<dyn StreamTranslator> {
        Box::new(Passthrough::default())
    }

    fn error_body(&self, e: &ApiError) -> Bytes {
        openai_error(e)
    }
}

/// Forwards every engine event unchanged, holding back only `[DONE]`
/// (chat completions and completions share it).
#[derive(Debug, Default)]
pub(crate) struct Passthrough {
    done: Option<Vec<u8>>,
}

impl StreamTranslator for Passthrough {
    fn on_event(&mut self, ev: &Event, _: Option<&Chunk<'_>>, out: &mut Vec<u8>) {
        if ev.is_done() {
            self.done = Some(ev.raw.clone());
        } else {
            out.extend_from_slice(&ev.raw);
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
