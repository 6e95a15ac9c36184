#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| lightning_gateway::fuzzing::engine_answer(data));
