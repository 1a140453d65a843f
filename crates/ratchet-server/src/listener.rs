//! The server's listener: TCP connections whose writes may stall only so long. A client that
//! stops reading (an event stream's, say) leaves the server's writes pending; after
//! `[limits] stream_stall_ms` of that its connection is closed, so it gives back its stream,
//! its place among the open streams and what its response held. A client that reads slowly
//! but reads is never cut off. Event streams begin with a `retry` hint, and a client that
//! reconnects with `Last-Event-ID` resumes where it stopped.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio_io_timeout::TimeoutStream;

/// A TCP listener whose connections time out a write that makes no progress for `stall`.
pub struct GuardedListener {
    tcp: TcpListener,
    stall: Duration,
}

impl GuardedListener {
    pub fn new(tcp: TcpListener, stall: Duration) -> GuardedListener {
        GuardedListener { tcp, stall }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

impl axum::serve::Listener for GuardedListener {
    type Io = Pin<Box<TimeoutStream<TcpStream>>>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, SocketAddr) {
        let (tcp, address) = axum::serve::Listener::accept(&mut self.tcp).await;
        let mut guarded = TimeoutStream::new(tcp);
        guarded.set_write_timeout(Some(self.stall));
        (Box::pin(guarded), address)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        GuardedListener::local_addr(self)
    }
}
