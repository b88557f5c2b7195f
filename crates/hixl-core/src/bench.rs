//! Baselines for benchmarks, measured in the same run as hixl: a plain TCP send/recv loop
//! between two processes with no protocol beyond a length prefix and a one-byte ack.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Starts a sink on `listen` ("ip:port"): every connection receives length-prefixed messages
/// into one buffer and acks each with one byte. Returns the bound address.
pub fn raw_tcp_sink(listen: &str) -> Result<String> {
    let l = TcpListener::bind(listen).map_err(|e| Error::param(format!("cannot listen on {listen}: {e}")))?;
    let addr = l.local_addr().map_err(|e| Error::failed(e.to_string()))?.to_string();
    std::thread::Builder::new()
        .name("hixl-raw-sink".into())
        .spawn(move || {
            for s in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let _ = sink_one(s);
                });
            }
        })
        .map_err(|e| Error::failed(e.to_string()))?;
    Ok(addr)
}

fn sink_one(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let mut len = [0u8; 8];
        s.read_exact(&mut len)?;
        let n = u64::from_le_bytes(len) as usize;
        if buf.len() < n {
            buf.resize(n, 1); // touch the pages before they are timed
        }
        s.read_exact(&mut buf[..n])?;
        s.write_all(&[1])?;
    }
}

/// Sends `iters` messages of `size` bytes to a sink over `streams` parallel connections (each
/// carries an equal share, one thread per connection) and returns each round's seconds, from
/// the first byte sent until every share is acked. One untimed warm-up round comes first.
pub fn raw_tcp_send(addr: &str, size: usize, iters: usize, streams: usize) -> Result<Vec<f64>> {
    let io = |e: std::io::Error| Error::not_connected(format!("raw tcp to {addr}: {e}"));
    let streams = streams.max(1);
    let mut socks = Vec::with_capacity(streams);
    for _ in 0..streams {
        let s = TcpStream::connect(addr).map_err(io)?;
        s.set_nodelay(true).map_err(io)?;
        s.set_read_timeout(Some(Duration::from_secs(60))).map_err(io)?;
        socks.push(s);
    }
    let share = size.div_ceil(streams);
    let buf = vec![7u8; share];
    let round = |s: &mut TcpStream, n: usize| -> std::io::Result<()> {
        s.write_all(&(n as u64).to_le_bytes())?;
        s.write_all(&buf[..n])?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack)
    };
    let mut out = Vec::with_capacity(iters);
    for i in 0..=iters {
        let t0 = Instant::now();
        if streams == 1 {
            round(&mut socks[0], size).map_err(io)?;
        } else {
            std::thread::scope(|sc| {
                let hs: Vec<_> = socks
                    .iter_mut()
                    .enumerate()
                    .map(|(k, s)| {
                        let n = share.min(size.saturating_sub(k * share));
                        sc.spawn(move || if n > 0 { round(s, n) } else { Ok(()) })
                    })
                    .collect();
                hs.into_iter()
                    .try_for_each(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("panic"))))
            })
            .map_err(io)?;
        }
        if i > 0 {
            out.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}

pub use crate::sys::vm::raw_cma;

/// Baseline for any copy: one thread copying `count` blocks of `block` bytes between two
/// buffers of this process (`copy_from_slice`, i.e. memcpy), both touched before timing.
/// Returns each round's seconds after one warm-up round.
pub fn raw_memcpy(block: usize, count: usize, iters: usize) -> Result<Vec<f64>> {
    let total = block
        .checked_mul(count)
        .filter(|&t| t > 0)
        .ok_or_else(|| Error::param(format!("block={block} x count={count} is not a valid size")))?;
    let src = vec![5u8; total];
    let mut dst = vec![1u8; total];
    let mut out = Vec::with_capacity(iters);
    for i in 0..=iters {
        let t0 = Instant::now();
        for (d, s) in dst.chunks_mut(block).zip(src.chunks(block)) {
            d.copy_from_slice(s);
        }
        std::hint::black_box(&mut dst);
        if i > 0 {
            out.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}
