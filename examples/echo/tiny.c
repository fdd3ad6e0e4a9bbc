/* The edge proxy benchmark's compiled app: what an autostart costs when the app itself starts in about a
 * millisecond (a Go or Rust server's start, not an interpreter's). `fauxmad bench proxy` builds it with `cc`
 * when the host has one: cc -O2 -o tiny examples/echo/tiny.c
 *
 * Listens on 127.0.0.1:$PORT; every request head (GETs only: no bodies) on a kept-alive connection gets
 * 200 with the machine's id. A process per connection (forked at accept; children reaped by the kernel), so
 * a proxy's pool of kept-alive connections is served side by side. */
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int main(void) {
    const char *port = getenv("PORT");
    const char *machine = getenv("FAUXMAD_MACHINE_ID");
    char body[256], answer[512], buf[65536];
    int one = 1;
    struct sockaddr_in addr = {0};
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    snprintf(body, sizeof body, "{\"machine\": \"%s\"}", machine ? machine : "local");
    int length = snprintf(answer, sizeof answer,
                          "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n\r\n%s",
                          strlen(body), body);
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port ? atoi(port) : 8000);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(listener, 1024) != 0) {
        perror("tiny: listen");
        return 1;
    }
    signal(SIGCHLD, SIG_IGN); /* no zombies: the kernel reaps the connections' processes */
    for (;;) {
        int conn = accept(listener, NULL, NULL);
        size_t have = 0;
        ssize_t got;
        if (conn < 0) continue;
        if (fork() != 0) { /* the parent (or a failed fork, which drops the connection) goes on accepting */
            close(conn);
            continue;
        }
        close(listener);
        while ((got = read(conn, buf + have, sizeof buf - 1 - have)) > 0) {
            char *end;
            have += (size_t)got;
            buf[have] = 0;
            while ((end = strstr(buf, "\r\n\r\n")) != NULL) { /* one answer per request head */
                size_t used = (size_t)(end + 4 - buf);
                if (write(conn, answer, (size_t)length) != length) break;
                memmove(buf, buf + used, have - used);
                have -= used;
                buf[have] = 0;
            }
            if (have >= sizeof buf - 1) break; /* a head too large for this app */
        }
        close(conn);
        _exit(0);
    }
}
