//! Incremental Server-Sent Events framing (pure: bytes in, events out), so the
//! proxy can forward each event the moment it is complete and the parser can be
//! fuzzed on its own.

/// One complete SSE event: its exact bytes (forwarded unchanged) and its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The event's bytes including the blank line that ends it.
    pub raw: Vec<u8>,
    /// `data:` lines joined with `\n` (empty when the event has none).
    pub data: Vec<u8>,
}

impl Event {
    pub fn is_done(&self) -> bool {
        self.data.trim_ascii() == b"[DONE]"
    }
}

/// Splits a byte stream into events. Events end at a blank line (`\n\n`,
/// `\r\n\r\n` or `\r\r`, per the WHATWG EventSource grammar).
#[derive(Debug)]
pub struct Parser {
    buf: Vec<u8>,
    /// Bytes of `buf` already scanned for a boundary.
    scanned: usize,
    /// Largest event accepted, complete or still arriving.
    max_event: usize,
}

/// Default largest event (a vLLM chunk is a few KB; 16 MiB leaves room for
/// huge logprobs); the gateway uses its `max_sse_event_bytes`.
pub const MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

impl Default for Parser {
    fn default() -> Self {
        Self::with_limit(MAX_EVENT_BYTES)
    }
}

impl Parser {
    pub fn new() -> Self {
        Self::default()
    }

    /// A parser refusing events larger than `max_event` bytes.
    pub fn with_limit(max_event: usize) -> Self {
        Parser {
            buf: Vec::new(),
            scanned: 0,
            max_event,
        }
    }

    /// Appends bytes and returns every event they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<Event>, String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        // Walk the buffer with a cursor and drop the consumed prefix once, so
        // a read holding many events costs O(bytes), not O(events × bytes).
        let mut start = 0;
        let mut from = self.scanned.saturating_sub(3);
        let too_big = |n: usize| format!("an SSE event exceeds {n} bytes (max_sse_event_bytes)");
        while let Some(end) = find_boundary(&self.buf, from.max(start)) {
            if end - start > self.max_event {
                return Err(too_big(self.max_event));
            }
            let raw = self.buf[start..end].to_vec();
            let data = extract_data(&raw);
            out.push(Event { raw, data });
            start = end;
            from = end;
        }
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        if self.buf.len() > self.max_event {
            return Err(too_big(self.max_event));
        }
        Ok(out)
    }

    /// Bytes of an unfinished event (the stream ended mid-event when non-empty).
    pub fn remainder(&self) -> &[u8] {
        &self.buf
    }
}

/// Index one past the blank line ending the first event at or after `from`.
/// Every boundary starts with `\r` or `\n`, so only those bytes are tried
/// (found with `memchr`, which skips the JSON between them many bytes at a time).
fn find_boundary(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i + 1 < buf.len() {
        i += memchr::memchr2(b'\n', b'\r', &buf[i..])?;
        if i + 1 >= buf.len() {
            return None;
        }
        match (buf[i], buf[i + 1]) {
            (b'\n', b'\n') => return Some(i + 2),
            // `\r\r` ends an event only if no `\n` follows: at the end of what
            // has arrived, wait for the next read (framing never depends on
            // where the reads were cut).
            (b'\r', b'\r') if i + 2 == buf.len() => return None,
            (b'\r', b'\r') if buf[i + 2] != b'\n' => return Some(i + 2),
            (b'\r', b'\n') => {
                if buf.get(i + 2) == Some(&b'\r') && buf.get(i + 3) == Some(&b'\n') {
                    return Some(i + 4);
                }
                if buf.get(i + 2) == Some(&b'\n') {
                    return Some(i + 3);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

fn extract_data(raw: &[u8]) -> Vec<u8> {
    let mut data = Vec::with_capacity(raw.len());
    let mut first = true;
    let mut start = 0;
    loop {
        let end = memchr::memchr(b'\n', &raw[start..]).map_or(raw.len(), |p| start + p);
        let line = &raw[start..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            if !first {
                data.push(b'\n');
            }
            data.extend_from_slice(rest);
            first = false;
        }
        if end == raw.len() {
            return data;
        }
        start = end + 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_events_across_arbitrary_chunks() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\n: comment\n\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut p = Parser::new();
            let mut events = p.feed(&stream[..cut]).unwrap_or_default();
            events.extend(p.feed(&stream[cut..]).unwrap_or_default());
            assert_eq!(events.len(), 4, "cut at {cut}");
            assert_eq!(events[0].data, b"{\"a\":1}");
            assert_eq!(events[1].data, b"{\"b\":2}");
            assert!(events[2].data.is_empty());
            assert!(events[3].is_done());
            let joined: Vec<u8> = events.iter().flat_map(|e| e.raw.clone()).collect();
            assert_eq!(joined, stream.to_vec());
        }
    }

    /// The byte-at-a-time framing the `memchr` version replaced, as the
    /// plain reference it must agree with.
    /// `(raw, data)` of each event, and the unfinished rest.
    type Framed = (Vec<(Vec<u8>, Vec<u8>)>, Vec<u8>);

    fn reference_events(stream: &[u8]) -> Framed {
        let (mut out, mut start, mut i) = (Vec::new(), 0, 0);
        while i + 1 < stream.len() {
            let end = match (stream[i], stream[i + 1]) {
                (b'\n', b'\n') => Some(i + 2),
                (b'\r', b'\r') if i + 2 < stream.len() && stream[i + 2] != b'\n' => Some(i + 2),
                (b'\r', b'\n') if stream.get(i + 2..i + 4) == Some(b"\r\n") => Some(i + 4),
                (b'\r', b'\n') if stream.get(i + 2) == Some(&b'\n') => Some(i + 3),
                _ => None,
            };
            match end {
                Some(e) => {
                    let raw = stream[start..e].to_vec();
                    let lines: Vec<&[u8]> = raw
                        .split(|b| *b == b'\n')
                        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
                        .filter_map(|l| l.strip_prefix(b"data:"))
                        .map(|r| r.strip_prefix(b" ").unwrap_or(r))
                        .collect();
                    out.push((raw.clone(), lines.join(&b'\n')));
                    (start, i) = (e, e);
                }
                None => i += 1,
            }
        }
        (out, stream[start..].to_vec())
    }

    proptest::proptest! {
        #![proptest_config(crate::util::proptest_config(512))]
        #[test]
        fn framing_matches_the_reference_under_any_chunking(
            stream in proptest::collection::vec(
                proptest::sample::select(b"\r\n\r\nda:ta x".to_vec()), 0..80),
            cuts in proptest::collection::vec(0usize..80, 0..6),
        ) {
            let mut p = Parser::new();
            let mut got = Vec::new();
            let mut last = 0;
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|c| *c <= stream.len()).collect();
            cuts.sort_unstable();
            cuts.push(stream.len());
            for c in cuts {
                got.extend(p.feed(&stream[last..c]).unwrap_or_default());
                last = c;
            }
            let got: Vec<(Vec<u8>, Vec<u8>)> = got.into_iter().map(|e| (e.raw, e.data)).collect();
            let (want, rest) = reference_events(&stream);
            proptest::prop_assert_eq!(got, want);
            proptest::prop_assert_eq!(p.remainder(), &rest[..]);
        }
    }

    #[test]
    fn events_over_the_limit_are_refused_whole_or_in_pieces() {
        let ev = b"data: 0123456789\n\n"; // 18 bytes
        assert_eq!(Parser::with_limit(18).feed(ev).map(|e| e.len()), Ok(1));
        assert!(
            Parser::with_limit(17).feed(ev).is_err(),
            "complete in one read"
        );
        let mut p = Parser::with_limit(17);
        assert!(p.feed(&ev[..10]).is_ok());
        assert!(p.feed(&ev[10..]).is_err(), "completed by a second read");
        let mut p = Parser::with_limit(8);
        assert!(p.feed(&ev[..9]).is_err(), "unfinished and already too big");
    }

    #[test]
    fn crlf_and_multiline_data() {
        let mut p = Parser::new();
        let ev = p
            .feed(b"data: x\r\ndata: y\r\n\r\ndata: z\n\n")
            .unwrap_or_default();
        assert_eq!(ev.len(), 2);
        assert_eq!(ev[0].data, b"x\ny");
        assert_eq!(ev[1].data, b"z");
        assert!(p.remainder().is_empty());
    }
}
