//! The coverage-guided differential target: `cargo xtask fuzz --minutes N`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = attn_fuzz::run_one(data) {
        panic!("{e}");
    }
});
