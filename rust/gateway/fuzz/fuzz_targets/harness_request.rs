#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lightning_gateway::fuzzing::harness_request(data));
