//! OpenAI completions (`POST /v1/completions`): like chat, the engine's own
//! dialect; ids on (`logprobs` as a count), the answer passes through.

use bytes::Bytes;
use hyper::StatusCode;
use serde_json::Value;

use super::openai_chat::{openai_error, passthrough_request, Passthrough};
use super::{Answer, Ctx, EngineRequest, Kept, Protocol, StreamTranslator};
use crate::error::ApiError;
use crate::wire::engine::Kind;

#[derive(Debug, Clone, Copy)]
pub struct OpenAiCompletions;

impl Protocol for OpenAiCompletions {
    fn name(&self) -> &'static str {
        "openai_completions"
    }

    fn engine_request(&self, body: Value, ctx: &mut Ctx) -> Result<EngineRequest, ApiError> {
        passthrough_request(body, Kind::Completion, ctx)
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn logprobs_become_a_count_unless_given() {
        let mut ctx = Ctx {
            want_ids: true,
            ..Default::default()
        };
        let r = OpenAiCompletions
            .engine_request(json!({"prompt": "x"}), &mut ctx)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.kind, Kind::Completion);
        assert_eq!(r.body["logprobs"], json!(0));
        let r = OpenAiCompletions
            .engine_request(json!({"prompt": "x", "logprobs": 3}), &mut ctx)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.body["logprobs"], json!(3));
    }
}
