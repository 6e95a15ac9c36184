//! Token ids and logprobs as bytes: the store's blobs (little-endian u32 ids,
//! f32 logprobs, one column each) and the compact columnar trace form (`GET /rollouts/{id}/trace?format=columnar`).
//!
//! Layout (all integers little-endian):
//! ```text
//! b"LTRC" | u32 version (1) | u32 header_len | header JSON (UTF-8)
//! | prompt ids:     u32 × Σ prompt_len
//! | completion ids: u32 × Σ completion_len
//! | logprobs:       f32 × Σ completion_len   (NaN where the call had none)
//! ```
//! The header is `{"rollout_id", "calls": [{...call fields without the arrays...,
//! "prompt_len", "completion_len", "has_logprobs"}]}`; a reader splits the three
//! arrays by cumulative lengths (numpy: `frombuffer` + `split`), no per-token parsing.

use serde_json::json;

use super::records::StoredCall;

pub fn ids_to_blob(ids: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ids.len() * 4);
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

pub fn blob_to_ids(blob: &[u8]) -> Vec<u32> {
    blob.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn f32s_to_blob(xs: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(xs.len() * 4);
    for x in xs {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

pub fn blob_to_f32s(blob: &[u8]) -> Vec<f32> {
    blob.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub const MAGIC: &[u8; 4] = b"LTRC";
pub const VERSION: u32 = 1;

pub fn encode(rollout_id: &str, calls: &[StoredCall]) -> Vec<u8> {
    let mut meta = Vec::with_capacity(calls.len());
    let (mut np, mut nc) = (0usize, 0usize);
    for c in calls {
        let p = c.prompt_ids.as_ref().map_or(0, Vec::len);
        let n = c.completion_ids.as_ref().map_or(0, Vec::len);
        np += p;
        nc += n;
        meta.push(json!({
            "seq": c.seq,
            "request_id": c.request_id,
            "choice_index": c.choice_index,
            "kind": c.kind,
            "finish_reason": c.finish_reason,
            "text": c.text,
            "status": c.status,
            "flags": c.flags,
            "delivered": c.delivered,
            "retry_count": c.retry_count,
            "weight_version": c.weight_version,
            "upstream": c.upstream,
            "http_status": c.http_status,
            "latency_ms": c.latency_ms,
            "usage": c.usage,
            "created": c.created,
            "has_prompt_ids": c.prompt_ids.is_some(),
            "has_completion_ids": c.completion_ids.is_some(),
            "prompt_len": p,
            "completion_len": n,
            "has_logprobs": c.logprobs.is_some(),
        }));
    }
    let header = json!({"rollout_id": rollout_id, "calls": meta}).to_string();
    let mut out = Vec::with_capacity(12 + header.len() + 4 * (np + 2 * nc));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for c in calls {
        for id in c.prompt_ids.iter().flatten() {
            out.extend_from_slice(&id.to_le_bytes());
        }
    }
    for c in calls {
        for id in c.completion_ids.iter().flatten() {
            out.extend_from_slice(&id.to_le_bytes());
        }
    }
    for c in calls {
        let n = c.completion_ids.as_ref().map_or(0, Vec::len);
        let lp = c.logprobs.as_deref().unwrap_or(&[]);
        for i in 0..n {
            // A logprob list shorter than the ids (a flagged call) is padded with NaN.
            out.extend_from_slice(&lp.get(i).copied().unwrap_or(f32::NAN).to_le_bytes());
        }
    }
    out
}
