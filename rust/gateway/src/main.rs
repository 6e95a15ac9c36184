//! `lightning-gateway`: the recording proxy as a plain binary (`--help` lists the flags).

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(lightning_gateway::cli::main_with_args(&args));
}
