// The floor under a per-I/O delay worker on this host, without blkstack:
// `sleep` measures one absolute 1 ms sleep (clock_nanosleep, then a
// self-armed timerfd): how late it wakes and its thread CPU. `chain M W S`
// runs QD1 at 1 ms the way the hybrid delay target does: the submitter
// (pinned to CPU S) arms the worker's timerfd for deadline - M us and
// blocks on a futex; the worker (pinned to CPU W) wakes, spins to the
// deadline and futex-wakes the submitter, which submits the next one.
// Prints IOPS, both threads' CPU per I/O and where the time went.
// Build and run (docs/BENCHMARKS.md, lab delay):
//   gcc -O2 -o /tmp/delay-floor docs/lab/delay.floor.c -lpthread
//   /tmp/delay-floor sleep; /tmp/delay-floor chain 50 1 1; /tmp/delay-floor chain 50 0 1
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/prctl.h>
#include <sys/timerfd.h>
#include <stdatomic.h>

static uint64_t now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1000000000ull+t.tv_nsec;}
static uint64_t tcpu(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec*1000000000ull+t.tv_nsec;}
static int cmp(const void*a,const void*b){uint64_t x=*(uint64_t*)a,y=*(uint64_t*)b;return x<y?-1:x>y;}
static void pr(const char*n,uint64_t*v,int k){qsort(v,k,8,cmp);printf("%-34s p10 %6.1f p50 %6.1f p90 %6.1f p99 %7.1f us\n",n,v[k/10]/1e3,v[k/2]/1e3,v[k*9/10]/1e3,v[k*99/100]/1e3);}
static void pin(int c){if(c<0)return;cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static void fwait(atomic_uint*w,unsigned v){syscall(SYS_futex,w,FUTEX_WAIT_PRIVATE,v,0,0,0);}
static void fwake(atomic_uint*w){syscall(SYS_futex,w,FUTEX_WAKE_PRIVATE,1,0,0,0);}
#define N 2000
static uint64_t a[N],b[N],c[N],d[N];

static void sleeps(void){
  prctl(PR_SET_TIMERSLACK,1);
  uint64_t c0=tcpu();
  for(int i=0;i<N/2;i++){uint64_t dl=now()+1000000;struct timespec ts={dl/1000000000,dl%1000000000};
    clock_nanosleep(CLOCK_MONOTONIC,TIMER_ABSTIME,&ts,0);a[i]=now()-dl;}
  uint64_t cpu=tcpu()-c0; pr("nanosleep 1ms lateness",a,N/2); printf("   thread CPU per sleep+wake %.1f us\n",cpu/1e3/(N/2));
  int fd=timerfd_create(CLOCK_MONOTONIC,0); c0=tcpu();
  for(int i=0;i<N/2;i++){uint64_t dl=now()+1000000;struct itimerspec it={{0,0},{dl/1000000000,dl%1000000000}};
    timerfd_settime(fd,TFD_TIMER_ABSTIME,&it,0);uint64_t x;read(fd,&x,8);a[i]=now()-dl;}
  cpu=tcpu()-c0; pr("timerfd 1ms lateness",a,N/2); printf("   thread CPU per arm+sleep+wake %.1f us\n",cpu/1e3/(N/2));
  close(fd);
}

// chain
static atomic_uint bword; static atomic_uint_fast64_t dl_shared, woke_at;
static int wcpu, bcpu, margin, bspin, iters; static uint64_t wcpu_ns, bcpu_ns;
static int tfd;
static void* worker(void*x){
  pin(wcpu); prctl(PR_SET_TIMERSLACK,1);
  uint64_t c0=tcpu();
  for(int i=0;i<iters;i++){
    uint64_t q; read(tfd,&q,8);              /* armed by the submitter for deadline-margin */
    uint64_t dl=atomic_load(&dl_shared);
    uint64_t w=now(); a[i]= w>dl? w-dl:0;
    while(now()<dl){}
    uint64_t t1=now(); b[i]=t1-dl; atomic_store(&woke_at,t1);
    atomic_store(&bword,1); if(!bspin) fwake(&bword);
  }
  wcpu_ns=tcpu()-c0; return 0;
}
static void* submitter(void*x){
  pin(bcpu); uint64_t c0=tcpu();
  for(int i=0;i<iters;i++){
    uint64_t st=now(); uint64_t dl=st+1000000; atomic_store(&dl_shared,dl); uint64_t t=dl-margin; struct itimerspec it={{0,0},{t/1000000000,t%1000000000}}; timerfd_settime(tfd,TFD_TIMER_ABSTIME,&it,0);
    while(!atomic_load(&bword)){ if(!bspin) fwait(&bword,0);} 
    uint64_t tt=now(); atomic_store(&bword,0); c[i]=tt-atomic_load(&woke_at); d[i]=tt-st;
  }
  bcpu_ns=tcpu()-c0; return 0;
}
static void chain(int wc,int bc,int m,int spin){
  wcpu=wc;bcpu=bc;margin=m;bspin=spin;iters=1000;
  tfd=timerfd_create(CLOCK_MONOTONIC,0); pthread_t t1,t2; uint64_t t0=now(); pthread_create(&t1,0,worker,0); pthread_create(&t2,0,submitter,0);
  pthread_join(t1,0);pthread_join(t2,0); double wall=(now()-t0)/1e9;
  printf("chain worker cpu%d submitter cpu%d margin %dus waiter %s: IOPS %.1f (%.2f%% of 1000); worker CPU/IO %.1f us, submitter CPU/IO %.1f us\n",
    wc,bc,m/1000,spin?"spin":"futex",iters/wall,iters/wall/10,wcpu_ns/1e3/iters,bcpu_ns/1e3/iters);
  pr("  worker wake past deadline",a,iters); pr("  completion past deadline",b,iters); pr("  waiter sees it after",c,iters); pr("  period",d,iters);
}
int main(int argc,char**argv){
  if(argc>1&&!strcmp(argv[1],"sleep")){sleeps();return 0;}
  int m=argc>2?atoi(argv[2]):0; int wc=argc>3?atoi(argv[3]):-1; int bc=argc>4?atoi(argv[4]):-1; int sp=argc>5?atoi(argv[5]):0;
  chain(wc,bc,m*1000,sp); return 0;
}
