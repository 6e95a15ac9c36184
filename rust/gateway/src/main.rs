//! `lightning-gateway`: the recording proxy as a plain binary.
//!
//! ```text
//! lightning-gateway --listen 127.0.0.1:8080 --upstream http://127.0.0.1:8000/v1 \
//!     [--upstream ...] --db ./lightning.db --admin-key KEY [--config gateway.toml]
//! ```

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(lightning_gateway::cli::main_with_args(&args));
}
